"""The FSDP2 engine: an HF model built on the meta device, parallelized with DTensor TP +
FSDP2 over the training mesh and loaded shard by shard (``engines.training.hf_weights``); inference in
micro-batches, loss backward with gradient accumulation, AdamW with grad-norm clipping and an
LR schedule, DCP state dicts.

One class, three heads, four roles:

- ``lm``: per-token log-probs and entropies of the response (actor; reference with
  ``trainable=False``);
- ``value``: per-token values V[b, j] = head(h[b, P_b + j - 1]), the value of the state that
  predicts response token j (verl's ``values[:, -R-1:-1]``) (critic);
- ``score``: one score per sample, the head at the sample's last real token (reward model).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from spmd_rl.config.schema import ActorConfig
from spmd_rl.distributed import timeline
from spmd_rl.distributed.accelerator import Accelerator
from spmd_rl.engines.training import fused_experts, lora, route_replay
from spmd_rl.engines.base import DTYPES, Engine, LossFn, local
from spmd_rl.engines.training.hf_weights import build_sharded
from spmd_rl.engines.training.logprobs import SeqBatch, lm_response_logprobs
from spmd_rl.engines.fsdp.packing import packed_for, packed_response_logprobs, packed_scores, packed_values
from spmd_rl.engines.fsdp.parallelize import parallelize
from spmd_rl.engines.training.schedule import lr_factor
from spmd_rl.engines.training.token_logprob import SamplingPolicy
from spmd_rl.engines.fsdp import bucket_gather


def global_grad_norm(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """sqrt(sum_p ||g_p||^2) over all shards, as a float64 host scalar. Gradients are grouped by
    (mesh, placements): each group's norm is computed on the device (one ``torch._foreach_norm``,
    the norm of the stacked norms) and reduced over its own mesh once (``full_tensor``), so parameters
    on different meshes (TP'd and replicated) mix safely with one host sync per group, not per
    parameter."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            g = p.grad
            key = (id(g.device_mesh), tuple(g.placements)) if isinstance(g, DTensor) else (None, str(g.device))
            groups.setdefault(key, []).append(g)
    total = torch.zeros((), dtype=torch.float64)
    for grads in groups.values():  # as torch.nn.utils.get_total_norm does for one mesh
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)))
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        total += norm.double().cpu() ** 2
    return total.sqrt()


class TrainEngine(Engine):
    """The FSDP2 (+ DTensor TP) implementation of :class:`Engine` for causal LMs."""

    @classmethod
    def from_config(cls, cfg, acc: Accelerator, mesh: DeviceMesh, policy: SamplingPolicy, **role) -> "TrainEngine":
        """The actor (or, with ``trainable=False``, the reference) of the run ``cfg`` describes
        (``recipe.train_backends``: every backend's engine offers this signature)."""
        return cls(cfg.model.path, acc, mesh, cfg.actor, cfg.model.dtype, policy=policy, seed=cfg.trainer.seed, **role)

    def __init__(  # noqa: PLR0913
        self,
        path: str | Path,
        acc: Accelerator,
        mesh: DeviceMesh,
        cfg: ActorConfig,
        compute_dtype: str,
        trainable: bool = True,
        total_steps: int = 1,
        policy: SamplingPolicy = SamplingPolicy(),
        head: str = "lm",
        seed: int = 0,
    ):
        """``policy``: the rollout's sampling policy (temperature, top-k, top-p); every log-prob
        and entropy is of that distribution (``engines.training.token_logprob``). A trainable LM with
        ``cfg.lora`` trains adapters only (``engines.training.lora``; ``seed`` draws them)."""
        self.head = head
        self.acc = acc
        self.cfg = cfg
        self.policy = policy
        compute = DTYPES[compute_dtype]
        master = DTYPES[cfg.param_dtype] if trainable else compute  # a frozen role needs no master copy
        mp = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32) if compute != master else None
        checkpointing = cfg.activation_checkpointing and trainable
        self.lora = cfg.lora if trainable and head == "lm" else None
        adapt = self.lora

        def shard(m: torch.nn.Module) -> torch.nn.Module:
            if adapt is not None:  # the base frozen in the compute dtype, the adapters in the master dtype
                lora.inject(m, adapt.rank, adapt.alpha, adapt.dropout, adapt.target_modules, master)
            return parallelize(m, mesh, mp, checkpointing=checkpointing, compile=cfg.compile)

        self.model = build_sharded(
            path, compute if adapt else master, acc.device, shard, head, fresh=lora.is_adapter if adapt else None
        )
        if adapt is not None:
            lora.init_adapters(self.model, seed)
        self.model.config.use_cache = False
        self.trainable = trainable
        self.optimizer = None
        self.scheduler = None
        self.step_count = 0
        self.gradient_sync: Callable[[list[torch.Tensor]], None] | None = None
        """Elastic replicas (``elastic.replicated_step.sum_gradients``): sums the gradients over the
        replicas in place before the clip and the step, or raises when one was lost."""
        if trainable:
            self.optimizer = torch.optim.AdamW(
                [p for p in self.model.parameters() if p.requires_grad],
                lr=cfg.optim.lr,
                betas=tuple(cfg.optim.betas),
                weight_decay=cfg.optim.weight_decay,
                foreach=True,
            )
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(
                self.optimizer, lambda s: lr_factor(s, cfg.optim.lr_schedule, cfg.optim.warmup_steps, total_steps)
            )
        else:
            self.model.requires_grad_(False)
        self.routers = route_replay.patch_hf(self.model) if trainable and head == "lm" and not cfg.compile else 0
        """The actor's MoE routers go through ``engines.training.route_replay`` (replay, router metrics)."""

    # -- forward ------------------------------------------------------------------------------
    def _routes(self, micro: SeqBatch):
        """An MoE actor's routers see the micro-batch's routes (``engines.training.route_replay``) in the
        forward's layout, through the forward and the backward inside this context."""
        if not self.routers:
            return contextlib.nullcontext()
        micro = micro.trim()
        lengths = micro.attention_mask.sum(1).tolist()
        if self.cfg.pack_sequences:
            p = packed_for(self.model, micro)
            start, size = (p.last + 1 - torch.tensor(lengths)).tolist(), p.input_ids.numel()
            index = lambda b, t: start[b] + t  # noqa: E731
        else:
            size, width = micro.input_ids.numel(), micro.input_ids.shape[1]
            index = lambda b, t: b * width + t  # noqa: E731
        routes, valid = route_replay.place(lengths, size, index, micro.routes)
        return route_replay.feeding(routes, valid, self.cfg.moe.router_replay == "rollout", self.acc.device)

    def _forward(self, micro: SeqBatch, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The head's outputs for one micro-batch, computed on its trimmed copy (no column of
        padding that no sample uses), packed when ``cfg.pack_sequences``
        (``engines.fsdp.packing``), and padded back to the micro-batch's response width."""
        width = micro.mask.shape[1]
        if self.cfg.pack_sequences:
            micro, dev = micro.trim(), self.acc.device
            if self.head == "score":
                return packed_scores(self.model, micro, dev), None
            if self.head == "lm":
                out, ent = packed_response_logprobs(self.model, micro, with_entropy, self.policy, dev)
            else:
                out, ent = packed_values(self.model, micro, dev), None
            pad = (0, width - out.shape[1])
            return torch.nn.functional.pad(out, pad), None if ent is None else torch.nn.functional.pad(ent, pad)
        micro = micro.trim().to(self.acc.device)
        if self.head == "score":  # the head runs on every position; keep them, pool at the last real token
            seen: list[torch.Tensor] = []
            hook = self.model.score.register_forward_hook(lambda _m, _i, out: seen.append(out))
            try:
                self.model(input_ids=micro.input_ids, attention_mask=micro.attention_mask)
            finally:
                hook.remove()
            last = micro.attention_mask.sum(1) - 1
            return seen[0][torch.arange(len(micro), device=last.device), last, 0].float(), None
        if self.head == "value":
            values = self.model(input_ids=micro.input_ids, attention_mask=micro.attention_mask).logits
            out, ent = values[..., 0].float().gather(1, micro.predictor) * micro.mask, None
        else:
            out, ent = lm_response_logprobs(self.model, micro, with_entropy, self.policy)
        pad = (0, width - out.shape[1])
        return torch.nn.functional.pad(out, pad), None if ent is None else torch.nn.functional.pad(ent, pad)

    @torch.no_grad()
    def infer(
        self, micro_batches: list[SeqBatch], with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The head's outputs (module docstring) for the micro-batches, concatenated in order:
        ([B, R] log-probs or values, or [B] scores; [B, R] entropies of an LM when asked)."""
        self.model.eval()
        outs = []
        for m in micro_batches:
            with self._routes(m):
                outs.append(self._forward(m, with_entropy))
        lp = torch.cat([o[0] for o in outs]).cpu()
        ent = torch.cat([o[1] for o in outs]).cpu() if with_entropy else None
        return lp, ent

    # -- update -------------------------------------------------------------------------------
    def train_step(
        self,
        micro_batches: list[SeqBatch],
        loss_fn: LossFn,
        with_entropy: bool = False,
        router: route_replay.RouterObjective | None = None,
    ) -> dict[str, float]:
        """Backward over all micro-batches (the loss function scales for accumulation, ``router``
        adds the MoE router terms), clip the global grad norm to ``grad_clip``, AdamW step, LR
        schedule step."""
        assert self.optimizer is not None and self.scheduler is not None, "reference engine has no optimizer"
        self.model.train()
        losses: list[torch.Tensor] = []  # summed once after the last backward: no host read per micro-batch
        try:
            for k, micro in enumerate(micro_batches):
                if (
                    self.cfg.accumulate_unsharded
                ):  # FSDP2 no-sync: one all-gather per module, reduce-scatter and reshard after the last backward
                    last = k == len(micro_batches) - 1
                    self.model.set_reshard_after_forward(False)
                    self.model.set_requires_gradient_sync(last)
                    self.model.set_reshard_after_backward(last)
                with self._routes(micro), route_replay.objective(router), timeline.span("forward_backward"):
                    lp, ent = self._forward(micro, with_entropy)
                    loss = loss_fn(lp, ent, k)
                    loss.backward()
                losses.append(loss.detach())
        finally:
            if self.cfg.accumulate_unsharded:  # forward-only passes reshard after each module again
                self.model.set_reshard_after_forward(True)
        with timeline.span("optimizer"):
            if self.gradient_sync is not None:
                self._sync_gradients()
            params = [p for p in self.model.parameters() if p.grad is not None]
            norm = global_grad_norm(params)
            coef = min(1.0, self.cfg.optim.grad_clip / (float(norm) + 1e-6))
            if coef < 1.0:
                torch._foreach_mul_([p.grad for p in params], coef)
            lr = self.scheduler.get_last_lr()[0]
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.step_count += 1
        return {
            "loss": float(torch.stack(losses).double().sum()) if losses else 0.0,
            "grad_norm": float(norm),
            "lr": lr,
        }

    def _sync_gradients(self) -> None:
        """``gradient_sync`` over every trainable parameter's gradient (zeros where no loss reached
        it: the same tensors on every replica); when it raises (a replica was lost) the
        gradients are dropped, so the redone iteration starts from none."""
        for p in self.model.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        try:
            self.gradient_sync([p.grad for p in self.model.parameters() if p.grad is not None])
        except BaseException:
            self.optimizer.zero_grad(set_to_none=True)
            raise

    # -- state ----------------------------------------------------------------------------------
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, FSDP2 / TP DTensor) of every parameter."""
        return self.model.named_parameters()

    def _base_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The model's parameters in checkpoint names, LoRA adapters left out."""
        return [(n, p) for n, p in self.model.named_parameters() if not lora.is_adapter(n)]

    def weight_shapes(self) -> list[tuple[str, list[int]]]:
        """Checkpoint names and full shapes (a DTensor's shape is the full one; fused MoE experts
        one expert at a time, ``engines.training.fused_experts``)."""
        return [s for name, p in self._base_parameters() for s in fused_experts.split_shape(name, list(p.shape))]

    def full_weights(self, dtype: torch.dtype, bucket_bytes: float) -> tuple[int, Iterator[tuple[str, torch.Tensor]]]:
        """One all-gather per bucket of FSDP2 shards (``engines.fsdp.bucket_gather``), in checkpoint
        names; with LoRA's ``sync: merged`` each adapted weight merged, W + (alpha / r) B A
        (``engines.training.lora``), with ``sync: adapter`` the base weights (``adapter_tensors`` go apart)."""
        buckets = bucket_gather.plan(self._base_parameters(), dtype.itemsize, bucket_bytes)
        peak = max(bucket_gather.in_flight(buckets, dtype.itemsize), default=0)
        deltas = lora.merge_deltas(self.model) if self.lora and self.lora.sync == "merged" else {}

        def merged(name: str, t: torch.Tensor) -> torch.Tensor:
            return (t.float() + deltas.pop(name)).to(dtype) if name in deltas else t

        return peak, (
            s
            for bucket in buckets
            for name, t in bucket_gather.gather(bucket, dtype)
            for s in fused_experts.split(name, merged(name, t))
        )

    def adapter_tensors(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """{``<linear>.lora_A`` / ``.lora_B``: the full adapter in ``dtype``} (collective over the mesh)."""
        return {n: lora.full(p).detach().to(dtype) for n, p in self.model.named_parameters() if lora.is_adapter(n)}

    def reference(self) -> Engine:
        """The reference policy of a LoRA actor: this engine with adapters off (``engines.training.lora``)."""
        assert self.lora is not None, "only a LoRA actor holds its reference"
        return lora.BaseModelView(self)

    def param_tensors(self) -> list[torch.Tensor]:
        return [local(p) for p in self.model.parameters()]

    def grad_tensors(self) -> list[torch.Tensor]:
        return [local(p.grad) for p in self.model.parameters() if p.grad is not None]

    def optimizer_tensors(self) -> list[torch.Tensor]:
        if self.optimizer is None:
            return []
        return [
            local(v)
            for state in self.optimizer.state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        ]

    def state_dict(self) -> dict:
        msd, osd = get_state_dict(
            self.model, self.optimizer or [], options=StateDictOptions(ignore_frozen_params=self.lora is not None)
        )
        if self.lora is not None:  # the adapters only (a tied LM head slips through ignore_frozen_params)
            msd = {k: v for k, v in msd.items() if lora.is_adapter(k)}
        return {
            "model": msd,
            "optim": osd,
            "scheduler": self.scheduler.state_dict() if self.scheduler else {},
            "steps": self.step_count,
        }

    def save(self, folder: str | Path, group=None) -> None:
        """Collective over ``group`` (``Engine.save``). A LoRA
        actor writes its adapters, their AdamW states and the schedule only."""
        dcp.save(self.state_dict(), checkpoint_id=str(folder), process_group=group)

    def load(self, folder: str | Path, group=None) -> None:
        """Load a DCP checkpoint; DCP reshards it onto the current mesh. Nothing but DCP
        metadata classes is unpickled (``engines.training.safe_dcp``)."""
        from spmd_rl.engines.training.safe_dcp import SafeLoadPlanner, SafeReader, verify

        verify(folder)
        state = self.state_dict()
        dcp.load(state, storage_reader=SafeReader(str(folder)), planner=SafeLoadPlanner(), process_group=group)
        set_state_dict(
            self.model,
            self.optimizer or [],
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=StateDictOptions(ignore_frozen_params=self.lora is not None, strict=self.lora is None),
        )
        if self.scheduler:
            self.scheduler.load_state_dict(state["scheduler"])
        self.step_count = int(state["steps"])
