"""The one place that owns memory moves does them in the order that bounds the device peak:
wake rollout weights -> load new weights -> swap the training state to host -> empty_cache ->
wake the KV cache; and back: sleep the rollout -> empty_cache -> reload. The device-only calls
(vLLM sleep/wake, empty_cache) are recorded through the same Resharder on CPU."""

from __future__ import annotations

import torch

from spmd_rl.config.schema import ReshardConfig
from spmd_rl.distributed.accelerator import Accelerator
from spmd_rl.engines.base import Engine
from spmd_rl.reshard.allgather_swap import Resharder
from spmd_rl.reshard.swap import resident_bytes


class RecordingAccelerator(Accelerator):
    calls: list = []

    def empty_cache(self) -> None:
        self.calls.append("empty_cache")


class TinyEngine(Engine):
    """A role through the engine interface only: the resharder sees nothing else."""

    trainable = True

    def __init__(self, acc, model):
        self.acc, self.model = acc, model

    def infer(self, micro_batches, with_entropy=False):
        raise NotImplementedError

    def train_step(self, micro_batches, loss_fn, with_entropy=False, router=None):
        raise NotImplementedError

    def weight_shapes(self):
        return [(n, list(p.shape)) for n, p in self.model.named_parameters()]

    def full_weights(self, dtype, bucket_bytes):
        return 0, ((n, p.detach().to(dtype)) for n, p in self.model.named_parameters())

    def param_tensors(self):
        return list(self.model.parameters())

    def grad_tensors(self):
        return [p.grad for p in self.model.parameters() if p.grad is not None]

    def optimizer_tensors(self):
        return []

    def save(self, folder, group=None):
        raise NotImplementedError

    def load(self, folder, group=None):
        raise NotImplementedError


class FakeRollout:
    weights_current = True
    serves_adapters = False  # full-weight sync (LoRA adapter sync: engines.vllm.adapter_sync)
    adapters_stale = False

    def __init__(self, calls: list, train_params):
        self.calls, self.params = calls, train_params

    def wake_weights(self):
        self.calls.append("wake_weights")

    def update_weights(self, weights):
        names = [n for n, _ in weights]  # consumes the bucketed gather
        self.calls.append(f"update_weights:{len(names)}")
        self.weights_current = True

    def wake_kv_cache(self):
        self.calls.append(f"wake_kv_cache(train_resident={resident_bytes(self.params)})")

    def sleep(self, discard_weights=False):
        self.calls.append("sleep(level 2)" if discard_weights else "sleep")
        self.weights_current = self.weights_current and not discard_weights

    def resident(self):
        return True

    def weight_bytes(self):
        return 0

    def kv_cache_bytes(self):
        return 0


def test_memory_moves_in_peak_bounding_order():
    calls: list = []
    RecordingAccelerator.calls = calls
    acc = RecordingAccelerator("cpu")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    params = list(model.parameters())
    r = Resharder(TinyEngine(acc, model), FakeRollout(calls, params), ReshardConfig(bucket_bytes=64), "float32")
    r.to_generation()
    assert calls == ["wake_weights", "update_weights:4", "empty_cache", "wake_kv_cache(train_resident=0)"]
    assert [phase for phase, _ in r.ledger.rows].count("gather") == 1  # one ledger row per gather, not per bucket
    calls.clear()
    r.to_training()
    assert calls == ["sleep", "empty_cache"] and resident_bytes(params) == sum(p.numel() * 4 for p in params)
