"""Resharding flow between the training state and the vLLM state (paper, "Allgather-Swap").

``to_generation``:
  1. gather full tensors from their FSDP/TP shards, one all-gather per bucket (at most
     ``reshard.bucket_bytes`` of temporaries alive, or one tensor's if larger),
  2. hand each to the rollout engine, which keeps only its TP slice, and free the bucket,
  3. allgather_swap only: move the actor's sharded params, grads and optimizer states to host
     and release their device storage.
``to_training`` moves them back before the update stage. In a run, ``reshard.residency`` calls
the same steps stage by stage (the actor's state stays on host through every stage that does
not declare it); the two-phase flow remains for the benchmarks and the engine tests.

The naive path gathers every tensor at once and keeps the training state resident. Both
record a memory ledger at each phase.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from spmd_rl.config.schema import ReshardConfig
from spmd_rl.engines.base import DTYPES, Engine, Rollout
from spmd_rl.reshard.ledger import Ledger
from spmd_rl.reshard.swap import HostSwap, resident_bytes


class Resharder:
    def __init__(self, train: Engine | None, rollout: Rollout | None, cfg: ReshardConfig, gen_dtype: str, acc=None):
        """Separated placement has one side per rank: the trainers no rollout engine (their
        gather is broadcast, ``reshard.broadcast``), the generators no actor."""
        self.train = train
        self.rollout = rollout
        self.cfg = cfg
        self.gen_dtype = DTYPES[gen_dtype]
        self.acc = acc or train.acc
        self.swap = HostSwap(self.acc)
        self.ledger = Ledger()
        self.temp_peak = 0

    # -- state accounting -----------------------------------------------------------------
    def _params(self) -> list[torch.Tensor]:
        return self.train.param_tensors()

    def _grads(self) -> list[torch.Tensor]:
        return self.train.grad_tensors()

    def _optim(self) -> list[torch.Tensor]:
        return self.train.optimizer_tensors()

    def record(self, phase: str, temp: int = 0) -> None:
        gen = (
            {"rollout_weights": self.rollout.weight_bytes(), "kv_cache": self.rollout.kv_cache_bytes()}
            if self.rollout is not None
            else {}
        )
        self.ledger.record(
            phase,
            actor_params=resident_bytes(self._params()),
            actor_grads=resident_bytes(self._grads()),
            actor_optim=resident_bytes(self._optim()),
            temp=temp,
            **gen,
        )

    # -- gather ----------------------------------------------------------------------------
    def weight_meta(self) -> list[tuple[str, torch.dtype, list[int]]]:
        """(HF name, generation dtype, full shape) of each tensor ``full_weights`` yields, in order."""
        return [(name, self.gen_dtype, shape) for name, shape in self.train.weight_shapes()]

    def full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor in the generation dtype) from the actor's engine (the FSDP
        engine: one all-gather per bucket, ``engines.fsdp.bucket_gather``). Every rank must consume it
        in the same order (the gathers are collectives). Shards are cast to the generation dtype
        before the gather (a cast is elementwise, so the result is the same bits as
        gather-then-cast): a bf16 rollout moves half the bytes of an fp32 master, and no full
        tensor in the master dtype is allocated."""
        limit = self.cfg.bucket_bytes if self.cfg.mode == "allgather_swap" else float("inf")
        peak, tensors = self.train.full_weights(self.gen_dtype, limit)
        self.temp_peak = max(self.temp_peak, peak)
        self.record("gather", temp=peak)  # once per gather: a ledger row costs the engine two RPCs
        yield from tensors

    # -- steps (the residency manager composes them per stage) ------------------------------
    def load_rollout(self) -> None:
        """Wake the rollout weights and load the actor's current ones, bucket by bucket. An
        engine serving LoRA adapters (``engines.vllm.adapter_sync``) loads the base weights only when
        it holds none (its first load, or after a level-2 sleep), then the adapters alone."""
        self.rollout.wake_weights()
        if not self.rollout.serves_adapters or not self.rollout.weights_current:
            self.rollout.update_weights(self.full_weights())
        if self.rollout.serves_adapters:
            self.rollout.update_adapters(self.train.adapter_tensors(self.gen_dtype))

    def offload_train(self) -> None:
        """The actor's local params, grads and optimizer states to host (bit-exact, storage level)."""
        self.swap.track(self._params() + self._grads() + self._optim())
        self.swap.offload()

    def reload_train(self) -> None:
        self.swap.reload()

    # -- the two-phase flow (benchmarks and engine tests) --------------------------------------
    def to_generation(self) -> None:
        """Order bounds the device peak (vLLM #15254, verl PR #6456): wake the rollout weights,
        load the new ones bucket by bucket, swap the training state to host, return the freed
        blocks (``empty_cache``), and only then wake the KV cache, so training state, weights
        and KV cache are never resident together."""
        self.record("before_reshard")
        self.load_rollout()
        if self.cfg.mode == "allgather_swap":
            self.offload_train()
        self.train.acc.empty_cache()
        self.rollout.wake_kv_cache()
        self.record("generate")

    def to_training(self) -> None:
        """Release the rollout's weights and KV cache (vLLM sleep), then reload the training state."""
        self.rollout.sleep()
        self.train.acc.empty_cache()
        self.reload_train()
        self.record("update")
