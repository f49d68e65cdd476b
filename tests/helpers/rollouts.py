"""A user's rollout engine, registered by nothing: ``rollout.engine: tests.helpers.rollouts:EchoRollout``
(docs/extending.md shows this file). It answers every request with the request's last context
token repeated, log-prob 0: a stand-in for a real engine, enough to show the seam."""

from __future__ import annotations

from spmd_rl.engines.base import Rollout, RolloutBuild, RolloutCapabilities, Sample, SamplingSpec


class EchoRollout(Rollout):
    capabilities = RolloutCapabilities(own_process=True)

    def __init__(self, build: RolloutBuild):
        self.cfg = build.cfg
        self.weights_current = True
        self.queue: list[tuple[object, list[int], SamplingSpec]] = []

    def submit(self, requests, specs) -> None:
        self.queue += [(key, context, spec) for (key, context), spec in zip(requests, specs)]

    def busy(self) -> bool:
        return bool(self.queue)

    def step(self):
        done, self.queue = self.queue, []
        return [
            (key, [Sample([ctx[-1]] * spec.max_tokens, [0.0] * spec.max_tokens)] * spec.n) for key, ctx, spec in done
        ]

    def update_weights(self, weights, meta=None) -> None:
        for _ in weights:  # consumed: the gather is collective
            pass

    def weight_bytes(self) -> int:
        return 0

    def kv_cache_bytes(self) -> int:
        return 0
