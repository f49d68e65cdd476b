"""The two engine interfaces. ``Engine``: what every training role's engine implements (actor,
reference, critic, reward model); the resharder, the stages, the update and the checkpoint code
depend on it, never on the FSDP or megatron class. ``Rollout``: what every generation engine
implements (``rollout.engine``: vLLM, or transformers' own generation); the stages, the
multi-turn loop, the resharder and the residency manager depend on it, never on vLLM.

Invariants a training engine keeps:

- ``full_weights`` yields every weight the rollout engine loads once, by its HF name and in its
  full shape, in the same order on every rank (its gathers are collectives), and
  ``weight_shapes`` lists the same names and shapes in that order without gathering;
- ``param_tensors`` / ``grad_tensors`` / ``optimizer_tensors`` are this rank's *local*
  storage (what the host swap moves and the ledger counts), never gathered copies;
- ``save`` then ``load`` into an engine of any layout restores the same full weights and
  optimizer state (DCP reshards).

Invariants a rollout engine keeps:

- a sample's ``logprobs`` are the log-probabilities of its tokens under the distribution they
  were drawn from: softmax(logits / T), renormalised over the top-k / top-p set when those are
  on (what the trainer's ``engines.training.token_logprob`` computes from the same weights);
- a request seeded ``s`` samples the same tokens every time from the same weights and context,
  whatever else is in the batch; at temperature 0 it is greedy;
- ``update_weights`` takes every weight the actor's ``full_weights`` yields (HF names, full
  shapes) and the next sample uses them; ``generate`` before the first load of a dummy start
  (or after a level-2 sleep) raises.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor

from spmd_rl.config.rollout_engines import RolloutCapabilities
from spmd_rl.data.sampling import Sample, SamplingSpec
from spmd_rl.distributed.accelerator import Accelerator
from spmd_rl.engines.training.route_replay import RouterObjective

__all__ = ["Engine", "Rollout", "RolloutBuild", "RolloutCapabilities", "Sample", "SamplingSpec"]

if TYPE_CHECKING:
    from spmd_rl.config.schema import LoraConfig, RolloutConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LossFn = Callable[[torch.Tensor, torch.Tensor | None, int], torch.Tensor]
"""(outputs [b, R]: log-probs or values, entropies [b, R] or None, micro-batch number) -> scalar loss to backprop."""


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a (possibly distributed) tensor."""
    return t.to_local() if isinstance(t, DTensor) else t


class Engine(ABC):
    acc: Accelerator
    trainable: bool

    @abstractmethod
    def infer(self, micro_batches: list, with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The role's outputs without gradients, one forward per micro-batch (the caller splits,
        as for ``train_step``), concatenated: per-token log-probs [B, R] (and entropies) of a
        policy, per-token values [B, R] of a critic, scores [B] of a reward model."""

    @abstractmethod
    def train_step(
        self, micro_batches: list, loss_fn: LossFn, with_entropy: bool = False, router: RouterObjective | None = None
    ) -> dict[str, float]:
        """Backward over the micro-batches, clip, optimizer and schedule step; loss, grad_norm, lr.
        ``loss_fn`` receives the same outputs as ``infer`` (with gradients) per micro-batch;
        ``router``: the MoE router terms added to the objective (``engines.training.route_replay``)."""

    @abstractmethod
    def weight_shapes(self) -> list[tuple[str, list[int]]]:
        """(HF name, full shape) of each tensor ``full_weights`` yields, in its order."""

    @abstractmethod
    def full_weights(self, dtype: torch.dtype, bucket_bytes: float) -> tuple[int, Iterator[tuple[str, torch.Tensor]]]:
        """(peak temporary bytes of the gather, an iterator of (HF name, full tensor in ``dtype``)):
        the rollout engine's weights, gathered with temporaries bounded by ``bucket_bytes``
        where the backend buckets; collective over the role's ranks."""

    @abstractmethod
    def param_tensors(self) -> list[torch.Tensor]:
        """Local storage of the parameters."""

    @abstractmethod
    def grad_tensors(self) -> list[torch.Tensor]:
        """Local storage of the gradients that exist now."""

    @abstractmethod
    def optimizer_tensors(self) -> list[torch.Tensor]:
        """Local storage of the optimizer states (none for a frozen role)."""

    @abstractmethod
    def save(self, folder: str | Path, group=None) -> None:
        """Write this role's state; collective over ``group``, the ranks that hold the role (the
        training side, ``Run.sides.group``; None = the world)."""

    @abstractmethod
    def load(self, folder: str | Path, group=None) -> None:
        """Read a state written by ``save`` in any layout (``group``: see ``save``)."""


@dataclass(frozen=True)
class RolloutBuild:
    """What every rollout engine is built from (``engines.rollouts.build_rollout_engine``).
    ``dummy_weights``: the first weights come from the actor's gather (colocated), so the engine
    need not read the checkpoint; generating before the first ``update_weights`` is refused.
    ``own_process``: the engine runs outside the rank's torch world (separated placement).
    ``record_routes``: every sample carries its MoE routes. ``lora``: the engine serves the
    adapters ``update_adapters`` publishes over the base weights."""

    path: str | Path
    acc: Accelerator
    cfg: RolloutConfig
    tp: int
    dtype: str
    max_model_len: int
    seed: int = 0
    distributed: bool = True
    own_process: bool = False
    dummy_weights: bool = False
    record_routes: bool = False
    expert_parallel: bool = False
    lora: LoraConfig | None = None


class Rollout(ABC):
    """A generation engine (module docstring's invariants). Requests are (key, context token ids)
    with a ``SamplingSpec`` each; ``submit`` queues them, ``step`` advances the engine and returns
    the finished ones by key, so multi-turn rollouts add a trajectory's next turn while others run."""

    capabilities: RolloutCapabilities
    cfg: RolloutConfig
    """Its temperature is a request's default; its top-p / top-k apply to every sampled request."""
    weights_current: bool
    """False while the engine holds no policy weights (dummy start, or a level-2 sleep)."""

    @classmethod
    def build(cls, *args, **kwargs) -> "Rollout":
        """``cls(RolloutBuild(*args, **kwargs))``."""
        return cls(RolloutBuild(*args, **kwargs))

    @property
    def serves_adapters(self) -> bool:
        """This run's weights reach the engine as LoRA adapters over a frozen base."""
        return False

    # -- generation -----------------------------------------------------------------------
    @abstractmethod
    def submit(self, requests: list[tuple[object, list[int]]], specs: list[SamplingSpec]) -> None:
        """Queue (key, context) requests; ``step`` returns each one's samples under its key."""

    @abstractmethod
    def busy(self) -> bool:
        """Whether a submitted request is unfinished."""

    @abstractmethod
    def step(self) -> list[tuple[object, list[Sample]]]:
        """Advance the engine: (key, samples by index) of the requests that finished."""

    def generate_stream(
        self,
        prompts: list[list[int]],
        n: int,
        max_tokens: int,
        temperature: float | None = None,
        seed: int | None = None,
        seed_keys: list[int] | None = None,
        top_p: float | None = None,
    ) -> Iterator[list[tuple[int, list[Sample]]]]:
        """As each prompt group finishes: [(prompt index, its n samples)]. Prompt p is one request
        of n samples seeded seed + key_p; at temperature 0 (greedy: one sample per request) it is
        n requests of one, the j-th seeded seed + key_p + j. ``seed_keys``: key_p, the global
        index of prompt p's first sample (default p * n), so a prompt samples the same tokens
        whichever share of a batch it is dealt into. ``top_p``: the nucleus of these requests (None:
        the engine's ``rollout.top_p``)."""
        self._begin_batch()
        temp = self.temperature if temperature is None else temperature
        per_request = 1 if temp == 0 else n
        keys = seed_keys if seed_keys is not None else [p * n for p in range(len(prompts))]
        if len(keys) != len(prompts):
            raise ValueError(f"{len(keys)} seed keys for {len(prompts)} prompts")
        owners = [p for p in range(len(prompts)) for _ in range(n // per_request)]
        specs = [
            SamplingSpec(
                max_tokens,
                temp,
                None if seed is None else seed + keys[p] + k % (n // per_request),
                per_request,
                top_p,
            )
            for k, p in enumerate(owners)
        ]
        self.submit([(k, prompts[p]) for k, p in enumerate(owners)], specs)
        groups: dict[int, list[tuple[int, list[Sample]]]] = {}
        while self.busy():
            for k, samples in self.step():
                got = groups.setdefault(owners[k], [])
                got.append((k, samples))
                if len(got) * per_request == n:
                    yield [(owners[k], [s for _, done in sorted(got) for s in done])]

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        max_tokens: int,
        temperature: float | None = None,
        seed: int | None = None,
        seed_keys: list[int] | None = None,
        top_p: float | None = None,
    ) -> list[Sample]:
        """n samples per prompt, prompt-major (sample i = prompt * n + k); seeded as ``generate_stream``."""
        done = dict(
            g
            for step in self.generate_stream(prompts, n, max_tokens, temperature, seed, seed_keys, top_p)
            for g in step
        )
        return [s for p in range(len(prompts)) for s in done[p]]

    def continue_samples(
        self,
        requests: list[tuple[list[int], int]],
        temperature: float | None = None,
        seed: int | None = None,
        seed_keys: list[int] | None = None,
    ) -> list[Sample]:
        """One sample per (context, max_tokens): at most max_tokens tokens continuing ``context``
        (the prompt and the response so far), request k seeded seed + key_k (``seed_keys``: each
        request's sample index; default k). Partial rollout's primitive: at temperature 0 a
        response continued in pieces equals the one generated at once."""
        self._begin_batch()
        temp = self.temperature if temperature is None else temperature
        keys = seed_keys if seed_keys is not None else list(range(len(requests)))
        if len(keys) != len(requests):
            raise ValueError(f"{len(keys)} seed keys for {len(requests)} requests")
        specs = [SamplingSpec(m, temp, None if seed is None else seed + key) for key, (_, m) in zip(keys, requests)]
        self.submit([(k, c) for k, (c, _) in enumerate(requests)], specs)
        done: dict[object, list[Sample]] = {}
        while self.busy():
            done.update(self.step())
        return [done[k][0] for k in range(len(requests))]

    @property
    def temperature(self) -> float:
        """The rollout config's sampling temperature (a request's default)."""
        return self.cfg.temperature

    def _begin_batch(self) -> None:
        """Before ``generate_stream`` / ``continue_samples`` queue a batch (none by default)."""

    @property
    def holds_policy(self) -> bool:
        """Whether the engine can generate from the policy now (``_require_weights``)."""
        return self.weights_current

    def _require_weights(self) -> None:
        """Refuse to generate while the engine holds no policy weights (module docstring)."""
        if not self.holds_policy:
            raise RuntimeError(
                "the rollout engine holds no policy weights (dummy start or a level-2 sleep): "
                "load them with update_weights before generating"
            )

    # -- weights --------------------------------------------------------------------------
    @abstractmethod
    def update_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], meta: list[tuple[str, torch.dtype, list[int]]] | None = None
    ) -> None:
        """Load new full weights (HF names), consumed one at a time; ``meta`` [(name, dtype,
        shape)] in iteration order when the engine runs in its own process."""

    def update_adapters(self, adapters: dict[str, torch.Tensor]) -> None:
        """Serve these LoRA adapters over the loaded base weights."""
        raise NotImplementedError(f"{type(self).__name__} serves no adapters")

    @property
    def adapters_stale(self) -> bool:
        """The served adapters must be published again (the engine dropped them on a sleep)."""
        return False

    # -- memory ---------------------------------------------------------------------------
    def sleep(self, discard_weights: bool = False) -> None:
        """Release the device (with ``discard_weights`` the weights too, no host copy)."""

    def wake_weights(self) -> None:
        """Bring back the weights (the KV cache stays released until ``wake_kv_cache``)."""

    def wake_kv_cache(self) -> None:
        """Bring back the KV cache."""

    def resident(self) -> bool:
        """Whether the engine holds device memory now."""
        return True

    @abstractmethod
    def weight_bytes(self) -> int:
        """Bytes of this rank's generation weights."""

    @abstractmethod
    def kv_cache_bytes(self) -> int:
        """Bytes of the KV cache (or its equivalent) the engine holds on this rank."""
