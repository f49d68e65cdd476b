"""``rollout.engine: hf``: a rollout engine on transformers' own model, no vLLM.

Each ``step`` takes every queued request, left-pads the batch and decodes it with the model's
KV cache (``DynamicCache``) until every row has stopped (EOS) or reached its token limit.
Sampling is this module's, not ``generate``'s: transformers draws every row of a batch from one
global generator (``generate`` and the continuous-batching ``generate_batch`` alike), so a
request's tokens would depend on its neighbours in the batch, and the seeded-request invariant
that partial rollouts and resumes rely on (``engines.base``) would not hold. Here sample i of a
request seeded s draws from its own ``torch.Generator`` seeded ``s * SEED_STRIDE + i``.

The policy (vLLM's, ``engines.training.token_logprob``): x = logits / T in float32; top-k keeps the tokens
whose x is at least the k-th largest; top-p sorts the kept x ascending and drops every token
whose cumulative probability is <= 1 - p, always keeping the largest. The token is drawn from
softmax(x) over the kept set and its log-prob is that distribution's. T = 0 is greedy: the
argmax of the logits, with the log-prob of softmax(logits) (no truncation), as vLLM reports it.

Weights: ``update_weights`` copies each (HF name, full tensor) into the module's own parameter
as it arrives, so the gatherer's bucket is the only temporary; the first load after a dummy
start (or a discarding sleep) must cover every parameter. What it shares with the training
engine: nothing but the bytes in flight. The module is a plain HF model, so it could alias the
gathered tensors instead of copying them, but ``Engine.full_weights`` makes no promise that a
yielded tensor is not a view of a reused bucket.

Memory: no KV cache outlives a ``step`` (``kv_cache_bytes`` is 0); ``sleep`` moves the weights
to host (or drops them) on a device and does nothing on CPU."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from spmd_rl.config.rollout_engines import ROLLOUTS
from spmd_rl.engines.base import DTYPES, Rollout, RolloutBuild, Sample, SamplingSpec

log = logging.getLogger("spmd_rl")

SEED_STRIDE = 1_000_003
"""Sample i of a request seeded s uses generator seed (s * SEED_STRIDE + i) mod 2^63 (n <
SEED_STRIDE): a torch generator takes a 64-bit seed, and a multi-turn request's seed is a
62-bit hash (``envs.multi_turn.request_seed``)."""


@dataclass
class _Row:
    key: object
    index: int
    context: list[int]
    max_tokens: int
    temperature: float
    generator: torch.Generator | None
    top_p: float


def truncate(x: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """x [B, V] float32 with every token outside the top-k / top-p set at -inf (module docstring)."""
    if 0 < top_k < x.shape[-1]:
        x = x.masked_fill(x < x.topk(top_k, dim=-1).values[:, -1:], float("-inf"))
    if top_p < 1.0:
        xs, order = x.sort(dim=-1)
        drop = xs.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
        drop[:, -1] = False
        x = x.masked_fill(torch.zeros_like(drop).scatter_(-1, order, drop), float("-inf"))
    return x


class HfRollout(Rollout):
    capabilities = ROLLOUTS.meta["hf"]

    def __init__(self, build: RolloutBuild):
        """In the rank's own process even under separated placement: it forms no process group,
        so it needs no world of its own."""
        from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

        self.cfg, self.acc = build.cfg, build.acc
        dtype = DTYPES[build.dtype]
        if build.dummy_weights:  # the actor's first gather overwrites every parameter
            config = AutoConfig.from_pretrained(build.path)
            with torch.device(build.acc.device):
                self.model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(build.path, dtype=dtype).to(build.acc.device)
        self.model.eval().requires_grad_(False)
        try:
            eos = GenerationConfig.from_pretrained(build.path).eos_token_id
        except OSError:
            eos = None
        eos = self.model.config.eos_token_id if eos is None else eos
        self.eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.pad = next(iter(self.eos), 0)
        self.max_model_len = build.max_model_len
        self.weights_current = not build.dummy_weights
        self._queue: list[_Row] = []
        self._unseeded = torch.Generator().manual_seed(build.seed)
        self._asleep = False
        self._shapes = {id(p): p.shape for p in self.model.parameters()}

    # -- generation -----------------------------------------------------------------------
    def submit(self, requests: list[tuple[object, list[int]]], specs: list[SamplingSpec]) -> None:
        self._require_weights()
        for (key, context), spec in zip(requests, specs, strict=True):
            if len(context) + spec.max_tokens > self.max_model_len:
                raise ValueError(
                    f"request {key!r}: {len(context)} context + {spec.max_tokens} new tokens exceed the engine's "
                    f"max_model_len {self.max_model_len}"
                )
            for i in range(spec.n):
                gen = None
                if spec.temperature > 0:
                    seed = (spec.seed * SEED_STRIDE + i) % 2**63 if spec.seed is not None else self._next_seed()
                    gen = torch.Generator(self.acc.device).manual_seed(seed)
                top_p = self.cfg.top_p if spec.top_p is None else spec.top_p
                self._queue.append(_Row(key, i, list(context), spec.max_tokens, spec.temperature, gen, top_p))

    def _next_seed(self) -> int:
        return int(torch.randint(0, 2**62, (), generator=self._unseeded))

    def busy(self) -> bool:
        return bool(self._queue)

    def step(self) -> list[tuple[object, list[Sample]]]:
        """Decode every queued row to its end: (key, samples by index) of every request."""
        rows, self._queue = self._queue, []
        samples = self._decode(rows) if rows else []
        done: dict[object, dict[int, Sample]] = {}
        for row, sample in zip(rows, samples):
            done.setdefault(row.key, {})[row.index] = sample
        return [(key, [got[i] for i in sorted(got)]) for key, got in done.items()]

    @torch.no_grad()
    def _decode(self, rows: list[_Row]) -> list[Sample]:
        from transformers import DynamicCache

        device = self.acc.device
        width = max(len(r.context) for r in rows)
        ids = torch.full((len(rows), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for b, r in enumerate(rows):
            ids[b, width - len(r.context) :] = torch.tensor(r.context)
            mask[b, width - len(r.context) :] = 1
        ids, mask = ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        logits = self.model(
            input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True
        ).logits[:, -1]
        out = [Sample([], []) for _ in rows]
        alive = [r.max_tokens > 0 for r in rows]
        for _ in range(max(r.max_tokens for r in rows)):
            if not any(alive):
                break
            chosen = self._choose(logits, rows, alive)
            for b, (token, lp) in enumerate(chosen):
                if not alive[b]:
                    continue
                out[b].token_ids.append(token)
                out[b].logprobs.append(lp)
                if token in self.eos:
                    out[b].stopped, alive[b] = True, False
                elif len(out[b].token_ids) >= rows[b].max_tokens:
                    alive[b] = False
            if not any(alive):
                break
            step_ids = torch.tensor([[t] for t, _ in chosen], device=device)
            mask = torch.cat([mask, mask.new_ones((len(rows), 1))], dim=-1)
            positions = positions[:, -1:] + 1
            logits = self.model(
                input_ids=step_ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True
            ).logits[:, -1]
        return out

    def _choose(self, logits: torch.Tensor, rows: list[_Row], alive: list[bool]) -> list[tuple[int, float]]:
        """(token, its log-prob) per row under each row's policy (module docstring); rows not
        alive get the pad token."""
        raw = logits.float()
        temps = torch.tensor([r.temperature if r.temperature > 0 else 1.0 for r in rows], device=raw.device)
        x = raw / temps[:, None]
        for top_p in {r.top_p for r in rows}:  # rows of one nucleus truncated together
            sampled = [b for b, r in enumerate(rows) if r.temperature > 0 and alive[b] and r.top_p == top_p]
            if sampled:
                x[sampled] = truncate(x[sampled], self.cfg.top_k, top_p)
        logp = torch.log_softmax(x, dim=-1)
        greedy = raw.argmax(dim=-1)
        chosen = []
        for b, r in enumerate(rows):
            if not alive[b]:
                chosen.append((self.pad, 0.0))
                continue
            if r.temperature > 0:
                token = int(torch.multinomial(logp[b].exp(), 1, generator=r.generator))
            else:
                token = int(greedy[b])
            chosen.append((token, float(logp[b, token])))
        return chosen

    # -- weights --------------------------------------------------------------------------
    def update_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], meta: list[tuple[str, torch.dtype, list[int]]] | None = None
    ) -> None:
        """Copy each tensor into the parameter of its HF name (module docstring)."""
        self._allocate()
        params = dict(self.model.named_parameters(remove_duplicate=False))
        loaded: set[int] = set()
        for name, tensor in weights:
            if name not in params:
                raise KeyError(f"update_weights: the rollout model has no parameter {name!r}")
            if params[name].shape != tensor.shape:
                raise ValueError(
                    f"update_weights: {name} has shape {list(tensor.shape)}, the model's is {list(params[name].shape)}"
                )
            params[name].copy_(tensor)
            loaded.add(id(params[name]))
        unset = [n for n, p in self.model.named_parameters() if id(p) not in loaded]
        if not self.weights_current and unset:
            raise ValueError(f"update_weights: the first load left {unset[:5]} unset")
        self.weights_current = True

    def _allocate(self) -> None:
        """Storage again for parameters a discarding sleep dropped (buffers were kept)."""
        for p in self.model.parameters():
            if p.numel() == 0 and p.shape != self._shapes[id(p)]:
                p.data = torch.empty(self._shapes[id(p)], dtype=p.dtype, device=self.acc.device)

    # -- memory ---------------------------------------------------------------------------
    def sleep(self, discard_weights: bool = False) -> None:
        """On a device: the weights to host, or dropped with ``discard_weights`` (parameters
        only: the buffers, such as rotary tables, are not in the actor's gather); on CPU nothing."""
        if self.acc.kind == "cpu" or self._asleep:
            return
        if discard_weights:
            for p in self.model.parameters():
                p.data = p.data.new_empty(0)
            self.weights_current = False
        else:
            self.model.to("cpu")
        self._asleep = True
        self.acc.empty_cache()

    def wake_weights(self) -> None:
        if self._asleep:
            self.model.to(self.acc.device)
            self._allocate()
            self._asleep = False

    def resident(self) -> bool:
        return not self._asleep

    def weight_bytes(self) -> int:
        seen, total = set(), 0
        for t in [*self.model.parameters(), *self.model.buffers()]:
            if t.device.type != "meta" and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total

    def kv_cache_bytes(self) -> int:
        return 0
