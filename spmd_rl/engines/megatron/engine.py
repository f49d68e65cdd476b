"""The megatron-core implementation of :class:`Engine` for causal LMs (actor, reference):
mcore's ``GPTModel`` with tensor parallelism (+ sequence parallelism), Megatron DDP with the
distributed optimizer (ZeRO-1 over data parallel), and every pass through mcore's own
schedules (``get_forward_backward_func``).

Objective. ``loss_fn`` (the stage's split-invariant objective, already multiplied by the DP
size to undo the average of gradients over data parallel) gets the same [b, R] log-probs and
entropies as the FSDP engine's; the schedule divides each micro-batch's loss by the number of
micro-batches (its legacy two-value contract), which ``train_step`` undoes, so the gradient is
the objective's whatever the split. Clipping is mcore's (coefficient max_norm / (norm + 1e-6),
as the FSDP engine's), AdamW with decoupled weight decay on every parameter (no bias / norm
exemption: the FSDP engine decays all), and the LR schedule is ``engines.training.schedule``'s.

Log-probs. The LM head's logits are gathered over TP (``runtime_gather_output``) and go
through the same fused kernel (``engines.training.token_logprob``) with the rollout's sampling policy,
on the positions that predict a response token only.

Mixed precision is mcore's: under bf16 the model holds bf16 parameters (``Float16Module``) and
the optimizer float32 main parameters; a frozen role holds compute-dtype parameters only.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh

from spmd_rl.config.schema import ActorConfig
from spmd_rl.distributed import timeline
from spmd_rl.distributed.accelerator import Accelerator
from spmd_rl.engines.training import route_replay
from spmd_rl.engines.base import DTYPES, Engine, LossFn
from spmd_rl.engines.training.logprobs import SeqBatch, logit_window, response_logprobs
from spmd_rl.engines.megatron import checkpoint, cpu_compat
from spmd_rl.engines.megatron.hf_map import to_hf, tp_join
from spmd_rl.engines.megatron.model import build_model, init_groups
from spmd_rl.engines.megatron.pipeline import StageWeights, stage_of, to_global
from spmd_rl.engines.training.safe_dcp import SafeLoadPlanner, SafeReader, verify
from spmd_rl.engines.training.schedule import lr_factor
from spmd_rl.engines.training.token_logprob import SamplingPolicy


def _mindspeed_adaptor() -> None:
    """On Ascend NPUs megatron-core runs through MindSpeed's adaptor, as MindSpeed RL does; the
    ``mindspeed`` name on PyPI is a placeholder, the package comes from Ascend's repository."""
    try:
        import mindspeed.megatron_adaptor  # noqa: F401  (patches megatron-core for torch_npu on import)
    except ImportError as exc:
        raise RuntimeError(
            "actor.backend=megatron on NPU needs MindSpeed: install it from https://gitee.com/ascend/MindSpeed "
            f"(the PyPI name is a placeholder), or use actor.backend=fsdp ({exc})"
        ) from None


def _prepare_megatron(device: torch.device, tp: int, pp: int, ep: int) -> None:
    """Quiet megatron's INFO and warnings, patch it for the CPU or NPU, and build its process
    groups (``parallel_state``) for this TP x PP x EP layout."""
    logging.getLogger("megatron").setLevel(logging.WARNING)  # its INFO lines print every config it builds
    warnings.filterwarnings("ignore", module=r"megatron\.")
    patch_megatron(device)
    init_groups(tp, pp, device, ep)


def patch_megatron(device: torch.device) -> None:
    """What megatron-core needs before a build on ``device``: the CPU patches there, on every device
    the norm's sequence parallel and the TransformerEngine-less gating (``cpu_compat``), MindSpeed
    on NPU."""
    cpu_compat.apply(device)
    cpu_compat.apply_norm_sequence_parallel()
    cpu_compat.apply_without_te()
    if device.type == "npu":
        _mindspeed_adaptor()


class MegatronEngine(Engine):
    @classmethod
    def from_config(cls, cfg, acc: Accelerator, mesh, policy: SamplingPolicy, **role) -> "MegatronEngine":
        """The actor (or, with ``trainable=False``, the reference) of the run ``cfg`` describes; megatron
        builds its own process groups (``mesh`` is unused: ``recipe.train_backends``'s one signature)."""
        t = cfg.parallel.train
        return cls(
            cfg.model.path,
            acc,
            cfg.actor,
            cfg.model.dtype,
            t.tp,
            t.sequence_parallel,
            policy=policy,
            pp=t.pp,
            ep=t.ep,
            **role,
        )

    def __init__(  # noqa: PLR0913
        self,
        path: str | Path,
        acc: Accelerator,
        cfg: ActorConfig,
        compute_dtype: str,
        tp: int,
        sequence_parallel: bool = False,
        trainable: bool = True,
        total_steps: int = 1,
        policy: SamplingPolicy = SamplingPolicy(),
        pp: int = 1,
        ep: int = 1,
    ):
        from megatron.core import parallel_state as ps

        _prepare_megatron(acc.device, tp, pp, ep)
        self.acc, self.cfg, self.policy, self.trainable = acc, cfg, policy, trainable
        self.tp, self.sp, self.pp, self.stage = tp, sequence_parallel, pp, ps.get_pipeline_model_parallel_rank()
        self.ep, self.ep_rank = ep, ps.get_expert_model_parallel_rank()
        compute = DTYPES[compute_dtype]
        master = DTYPES[cfg.param_dtype] if trainable else compute  # a frozen role needs no master copy
        model, self.shape = build_model(
            path,
            master,
            compute,
            tp,
            ps.get_tensor_model_parallel_rank(),
            sequence_parallel,
            recompute=cfg.activation_checkpointing and trainable,
            pp=pp,
            stage=self.stage,
            device=acc.device,
            ep=ep,
            ep_rank=self.ep_rank,
        )
        self.stages = StageWeights(path, self.shape, model.config, pp, acc.device, ep)
        self.routers = route_replay.patch_mcore(model) if trainable and self.shape.experts else 0
        """The actor's MoE routers go through ``engines.training.route_replay`` (replay, router metrics)."""
        model.to(acc.device)
        self.optimizer = None
        self.mixed = trainable and compute != master
        self.step_count, self.total_steps = 0, total_steps
        if not trainable:
            model.requires_grad_(False)
            self.model = model
            return
        self._build_trainable(model, self.mixed)
        self._log_layout(model.config)

    def _log_layout(self, c) -> None:
        from megatron.core import parallel_state as ps

        logging.getLogger("spmd_rl").info(
            "actor: megatron-core GPTModel tp=%d sequence_parallel=%s pp=%d dp=%d%s, distributed optimizer, %s",
            c.tensor_model_parallel_size,
            c.sequence_parallel,
            self.pp,
            ps.get_data_parallel_world_size(),
            f" ep={self.ep} ({self.shape.experts} experts)" if self.shape.experts else "",
            "bf16 with float32 main params" if self.mixed else str(c.params_dtype).removeprefix("torch."),
        )

    def _build_trainable(self, model, mixed: bool) -> None:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.transformer.module import Float16Module

        config = model.config
        if mixed:
            model = Float16Module(config, model)
        ddp = DistributedDataParallel(
            config,
            DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True
            ),
            model,
        )
        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = ddp.no_sync
        a = self.cfg.optim
        with cpu_compat.cuda_as_cpu(self.acc.device):
            self.optimizer = get_megatron_optimizer(
                OptimizerConfig(
                    optimizer="adam",
                    lr=a.lr,
                    weight_decay=a.weight_decay,
                    adam_beta1=a.betas[0],
                    adam_beta2=a.betas[1],
                    adam_eps=1e-8,
                    clip_grad=a.grad_clip,
                    bf16=mixed,
                    params_dtype=config.params_dtype,
                    use_distributed_optimizer=True,
                ),
                [ddp],
                config_overrides={},
            )
        self.model = ddp

    # -- passes ---------------------------------------------------------------------------
    def _logits(self, model, micro: SeqBatch) -> torch.Tensor:
        """Full-vocabulary logits [b, s, V] of a trimmed, right-padded micro-batch (padded to a
        multiple of tp under sequence parallelism, which splits the sequence). No attention mask:
        on right-padded rows the SDPA core attention's causal mask is exact at every valid
        position (``megatron.attention``)."""
        ids = micro.input_ids
        pad = (-ids.shape[1]) % self.tp if self.sp else 0
        if pad:
            ids = torch.nn.functional.pad(ids, (0, pad))
        return model(input_ids=ids, position_ids=None, attention_mask=None, runtime_gather_output=True)

    def _run(self, micro_batches: list[SeqBatch], forward_only: bool, consume) -> None:
        """One pass of mcore's schedule; ``consume(k, micro, logits)`` returns micro-batch k's
        loss (a tensor the schedule backprops unless ``forward_only``)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        batches = [m.trim().to(self.acc.device) for m in micro_batches]

        def forward_step(it, model):
            k, micro = next(it)
            self._feed_routes(micro)
            logits = self._logits(model, micro)
            return logits, lambda out: (consume(k, micro, out), {})

        longest = max((m.input_ids.shape[1] for m in batches), default=1)
        try:
            get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter(enumerate(batches)),
                model=[self.model],
                num_microbatches=len(batches),
                seq_length=longest,
                micro_batch_size=1,
                forward_only=forward_only,
            )
        finally:
            route_replay.stop()

    def _feed_routes(self, micro: SeqBatch) -> None:
        """An MoE actor's routers see this micro-batch's routes (``engines.training.route_replay``) until
        the next one's: mcore runs a micro-batch's backward (and its recompute) before the next
        forward. mcore flattens tokens sequence-first: token t of sample b is row t * b_count + b
        (MoE runs without TP, so without sequence parallelism's split)."""
        if not self.routers:
            return
        count, seq = micro.input_ids.shape
        routes, valid = route_replay.place(
            micro.attention_mask.sum(1).tolist(), count * seq, lambda b, t: t * count + b, micro.routes
        )
        route_replay.start(routes, valid, self.cfg.moe.router_replay == "rollout", self.acc.device)

    def _response(
        self, micro: SeqBatch, logits: torch.Tensor, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        lo, hi = logit_window(micro)
        return response_logprobs(logits[:, lo:hi], micro, with_entropy, self.policy, first=lo)

    @torch.no_grad()
    def infer(
        self, micro_batches: list[SeqBatch], with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.model.eval()
        outs: dict[int, tuple] = {}
        width = max((m.mask.shape[1] for m in micro_batches), default=1)

        def keep(k, micro, logits):
            lp, ent = self._response(micro, logits, with_entropy)
            outs[k] = tuple(
                None if t is None else torch.nn.functional.pad(t, (0, width - t.shape[1])).cpu() for t in (lp, ent)
            )
            return logits.new_zeros(())

        self._run(micro_batches, True, keep)
        sizes = [(len(m), width) for m in micro_batches]
        outs = self.stages.from_last(
            [outs.get(k, (None, None)) for k in range(len(micro_batches))], sizes, with_entropy
        )
        lp = torch.cat([o[0].cpu() for o in outs])
        ent = torch.cat([o[1].cpu() for o in outs]) if with_entropy else None
        return lp, ent

    def train_step(
        self,
        micro_batches: list[SeqBatch],
        loss_fn: LossFn,
        with_entropy: bool = False,
        router: route_replay.RouterObjective | None = None,
    ) -> dict[str, float]:
        assert self.optimizer is not None, "a frozen role has no optimizer"
        self.model.train()
        n = len(micro_batches)
        total = []
        widths = [m.mask.shape[1] for m in micro_batches]
        seen: dict[int, tuple] = {}  # the last stage's outputs, for the other stages

        def loss_of(k, micro, logits):
            lp, ent = self._response(micro, logits, with_entropy)
            pad = (0, widths[k] - lp.shape[1])
            lp, ent = torch.nn.functional.pad(lp, pad), None if ent is None else torch.nn.functional.pad(ent, pad)
            loss = loss_fn(lp, ent, k)
            total.append(loss.detach())
            seen[k] = (lp.detach(), None if ent is None else ent.detach())
            return loss * n  # the schedule divides by the number of micro-batches

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        o = self.cfg.optim
        lr = o.lr * lr_factor(self.step_count, o.lr_schedule, o.warmup_steps, self.total_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        with route_replay.objective(router), timeline.span("forward_backward"):
            self._run(micro_batches, False, loss_of)
        if self.pp > 1:  # loss_fn's contract: called once per micro-batch on every rank, the stages without outputs too
            got = self.stages.from_last(
                [seen.get(k, (None, None)) for k in range(n)],
                [(len(m), w) for m, w in zip(micro_batches, widths)],
                with_entropy,
            )
            if self.stage < self.pp - 1:
                with torch.no_grad():
                    total += [loss_fn(lp, ent, k).detach() for k, (lp, ent) in enumerate(got)]
        with cpu_compat.cuda_as_cpu(self.acc.device), timeline.span("optimizer"):
            _ok, grad_norm, _zeros = self.optimizer.step()
        self.step_count += 1
        return {"loss": float(torch.stack(total).sum()) if total else 0.0, "grad_norm": float(grad_norm), "lr": lr}

    # -- weights and state ----------------------------------------------------------------------
    def named_model_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(global mcore name, this rank's tensor): without the wrappers' ``module.`` prefixes,
        decoder layers numbered over all stages, a tied last stage's copy of the embedding named
        as the embedding (``pipeline``)."""
        for name, p in self.model.named_parameters():
            local = name.removeprefix("module.").removeprefix("module.")
            yield (
                to_global(
                    local,
                    self.shape.layers,
                    self.pp,
                    self.stage,
                    self.shape.tied,
                    self.shape.experts // self.ep,
                    self.ep_rank,
                ),
                p,
            )

    def weight_shapes(self) -> list[tuple[str, list[int]]]:
        return [
            (hf, list(t.shape))
            for name in self.stages.names
            for hf, t in to_hf(name, self.stages.meta(name), self.shape)
        ]

    def full_weights(self, dtype: torch.dtype, bucket_bytes: float) -> tuple[int, Iterator[tuple[str, torch.Tensor]]]:
        """Every parameter of every stage on every rank, in ``weight_shapes`` order: one TP
        all-gather per parameter (cast to ``dtype`` first) on its stage, a broadcast from that
        stage over the pipeline group, reassembled and split into HF tensors; the temporary is
        one full parameter at a time (returned as the peak)."""
        from megatron.core import parallel_state as ps

        group = ps.get_tensor_model_parallel_group()
        own = {
            n: p for n, p in self.named_model_params() if stage_of(n, self.shape.layers, self.pp) == self.stage
        }  # not a tied copy
        peak = max((self.stages.meta(n).numel() * dtype.itemsize * 2 for n in self.stages.names), default=0)

        def gather() -> Iterator[tuple[str, torch.Tensor]]:
            for name in self.stages.names:
                full = None
                if name in own:
                    local = own[name].detach().to(dtype)
                    parts = [local]
                    if self.tp > 1:
                        parts = [torch.empty_like(local) for _ in range(self.tp)]
                        torch.distributed.all_gather(parts, local, group=group)
                    full = tp_join(name, parts)
                yield from to_hf(name, self.stages.share(name, full, dtype), self.shape)

        return peak, gather()

    def param_tensors(self) -> list[torch.Tensor]:
        return [p for _, p in self.named_model_params()]

    def grad_tensors(self) -> list[torch.Tensor]:
        return [g for _, p in self.named_model_params() if (g := getattr(p, "main_grad", None)) is not None]

    def optimizer_tensors(self) -> list[torch.Tensor]:
        if self.optimizer is None:
            return []
        inner = [getattr(o, "optimizer", None) for o in getattr(self.optimizer, "chained_optimizers", [self.optimizer])]
        model = {p.untyped_storage().data_ptr() for p in self.param_tensors()}
        out = []
        for opt in (o for o in inner if o is not None):
            out += [p for g in opt.param_groups for p in g["params"]]  # main parameters: float32 copies under bf16
            out += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
        return [
            t for t in out if t.untyped_storage().data_ptr() not in model
        ]  # float32 main params are views of the model's

    def _host_tp_mesh(self) -> DeviceMesh:
        """The TP group as a CPU mesh: the checkpoint's tensors live in host memory (the
        world's backend serves host tensors on every device kind, ``accelerator.BACKENDS``)."""
        from megatron.core import parallel_state as ps

        return DeviceMesh.from_group(ps.get_tensor_model_parallel_group(), "cpu")

    def save(self, folder: str | Path, group=None) -> None:
        """HF-named float32 masters and AdamW moments through DCP (``megatron.checkpoint``),
        streamed to the host a parameter at a time; collective over ``group`` (``Engine.save``)."""
        state = checkpoint.state_dict(self, self._host_tp_mesh())
        dcp.save(state, checkpoint_id=str(folder), process_group=group)

    def load(self, folder: str | Path, group=None) -> None:
        """A checkpoint of any TP / DP layout; nothing but DCP metadata classes is unpickled."""
        verify(folder)
        state = checkpoint.empty_state_dict(self, self._host_tp_mesh())  # the layout to read into
        dcp.load(state, storage_reader=SafeReader(str(folder)), planner=SafeLoadPlanner(), process_group=group)
        checkpoint.load_into(self, state)
