"""Resumable, deterministic prompt sampler: epoch e visits a permutation seeded by (seed, e);
the state (epoch, offset) goes into every checkpoint, so a resumed run draws exactly the
prompts the uninterrupted run would have."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplerState:
    epoch: int = 0
    offset: int = 0


class PromptSampler:
    def __init__(self, size: int, seed: int, shuffle: bool = True, state: SamplerState | None = None):
        self.size = size
        self.seed = seed
        self.shuffle = shuffle
        self.state = state or SamplerState()

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.size))
        g = torch.Generator().manual_seed(self.seed * 100003 + epoch)
        return torch.randperm(self.size, generator=g).tolist()

    def next_batch(self, n: int) -> list[int]:
        """The next ``n`` prompt positions, continuing into the next epoch when needed."""
        out: list[int] = []
        while len(out) < n:
            order = self._order(self.state.epoch)
            take = order[self.state.offset : self.state.offset + n - len(out)]
            out += take
            self.state.offset += len(take)
            if self.state.offset >= self.size:
                self.state = SamplerState(self.state.epoch + 1, 0)
        return out


def sampler_for(cfg, size: int) -> PromptSampler:
    """The run's sampler: order seeded by ``trainer.seed``, shuffled when ``data.shuffle``."""
    return PromptSampler(size, cfg.trainer.seed, cfg.data.shuffle)
