"""Megatron engine checkpoints in the FSDP engine's layout: HF names, full logical tensors,
``torch.distributed.checkpoint`` (DCP) with the safe reader, so a checkpoint written under one
layout (TP 2, DP 1) resumes under another (TP 1, DP 2), and ``spmd-rl export`` / ``eval`` read
it as they read an FSDP one.

Saved per parameter (mcore name -> HF names, ``hf_map``):

- ``model/<hf>``: the float32 master weight (mcore's main parameter under bf16 mixed
  precision; the parameter itself in float32);
- ``optim/state/<hf>/{exp_avg,exp_avg_sq}``: AdamW's moments; ``optim/step``: the AdamW step;
- ``steps``: optimizer steps taken (the LR schedule's position).

Each is a DTensor over this rank's TP group: ``Shard(d)`` of the HF tensor for TP-split
weights (the local QKV rows are whole KV groups, so they split into the local q, k and v rows;
fc1's [gate_r; up_r] into the local gate and up rows), ``Replicate`` for norms. DP replicas
write the same chunks, which DCP keeps once. The distributed optimizer holds a contiguous range
of each parameter's flat elements per DP rank: ranges are assembled into the TP-local tensor
by a sum over DP (each element has one owner) before saving, and sliced back after loading.

Streamed through host memory, one parameter at a time: the save assembles a parameter's
float32 master and moments on the device, copies them to host tensors and drops the device
ones before the next parameter, so the device transient is 3 x 4 bytes x the largest TP-local
parameter, not x every parameter (about 49 GB per GPU for 32B at TP 8). The load reads into
empty host tensors (no device memory, no collective) and copies each parameter's slices onto
the device as it writes them. The host holds the TP-local states of every parameter (12 bytes
per TP-local parameter element) between the assembly and DCP's write, as mcore's async save
stages its state to the host.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from spmd_rl.engines.megatron.hf_map import Shape, from_hf_parts, hf_names, to_hf, tp_dim

MOMENTS = ("exp_avg", "exp_avg_sq")


def distributed_optimizers(optimizer) -> list:
    """The ``DistributedOptimizer``s inside mcore's (chained) optimizer: one, or with MoE a
    second for the expert parameters (sharded over the expert data-parallel group)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _optimizer_of(optimizers: list, p):
    return next((o for o in optimizers if p in o.model_param_group_index_map), optimizers[0])


def _dp_group(p):
    """The group over which the distributed optimizer shards ``p``: mcore marks expert
    parameters ``allreduce = False`` (their gradients are summed over the expert DP group)."""
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_group() if getattr(p, "allreduce", True) else ps.get_expert_data_parallel_group()


def local_shape(s: Shape, tp: int) -> Shape:
    return Shape(s.layers, s.nh // tp, s.ng // tp, s.hd, s.tied, s.experts, s.sparse)


def _owned(opt, p) -> slice | None:
    if p not in opt.model_param_group_index_map:
        return None
    r = opt._get_model_param_range_map(p)["param"]
    return slice(r.start, r.end)


def tp_local_states(opt, p, mixed: bool, dp_group) -> dict[str, torch.Tensor]:
    """The TP-local float32 master and moments of model parameter ``p``, assembled over DP."""
    own, shard = _owned(opt, p), None
    if own is not None:
        shard = opt._get_main_param_and_optimizer_states(p)
    out = {}
    for key in ("param", *MOMENTS):
        if key == "param" and not mixed:
            out[key] = p.detach().float().clone()
            continue
        full = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
        if own is not None and key in shard:
            full[own] = shard[key].float().reshape(-1)
        dist.all_reduce(full, group=dp_group)
        out[key] = full.view(p.shape)
    return out


def _pieces(name: str, local: torch.Tensor, s: Shape, tp: int, mesh: DeviceMesh) -> Iterator[tuple[str, DTensor]]:
    dim = tp_dim(name)
    placement = Replicate() if dim is None else Shard(dim)
    for hf, t in to_hf(name, local, local_shape(s, tp)):
        yield hf, DTensor.from_local(t.contiguous(), mesh, [placement], run_check=False)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of ``t``; a copy on CPU too, so the device tensor it came from is free once
    its caller drops it, whatever the device (module docstring)."""
    return torch.empty(t.shape, dtype=t.dtype, device="cpu").copy_(t)


def _layout(name: str, states: dict[str, torch.Tensor], engine, mesh: DeviceMesh, model: dict, state: dict) -> None:
    """File one parameter's TP-local master and moments under their HF names."""
    model.update(_pieces(name, states["param"], engine.shape, engine.tp, mesh))
    for key in MOMENTS:
        for hf, d in _pieces(name, states[key], engine.shape, engine.tp, mesh):
            state.setdefault(hf, {})[key] = d


def _wrap(engine, model: dict, state: dict) -> dict:
    return {
        "model": model,
        "optim": {"state": state, "step": torch.tensor(engine.step_count)},
        "steps": engine.step_count,
    }


def state_dict(engine, mesh: DeviceMesh) -> dict:
    """The DCP state dict of a trainable :class:`MegatronEngine`, in host tensors over ``mesh``
    (a CPU mesh of the TP group), assembled one parameter at a time (module docstring)."""
    optimizers = distributed_optimizers(engine.optimizer)
    model, state = {}, {}
    for name, p in engine.named_model_params():
        device_states = tp_local_states(_optimizer_of(optimizers, p), p, engine.mixed, _dp_group(p))
        host = {key: to_host(t) for key, t in device_states.items()}
        del device_states  # the device holds one parameter's states at a time
        _layout(name, host, engine, mesh, model, state)
    return _wrap(engine, model, state)


def empty_state_dict(engine, mesh: DeviceMesh) -> dict:
    """The layout of :func:`state_dict` in empty host tensors: what ``dcp.load`` reads into.
    Neither device memory nor a collective."""
    model, state = {}, {}
    for name, p in engine.named_model_params():
        host = {key: torch.empty(p.shape, dtype=torch.float32) for key in ("param", *MOMENTS)}
        _layout(name, host, engine, mesh, model, state)
    return _wrap(engine, model, state)


def _join(name: str, parts: dict[str, torch.Tensor], s: Shape, tp: int) -> torch.Tensor:
    """The TP-local mcore tensor from its HF pieces' local tensors (inverse of ``to_hf``)."""
    return from_hf_parts(name, [parts[n] for n in hf_names(name)], local_shape(s, tp))


def load_into(engine, loaded: dict) -> None:
    """Write a loaded ``state_dict`` (host tensors) into the engine: model parameters, the
    distributed optimizer's master ranges and moments, the step counters. Each parameter's
    slices are copied onto the device as they are written."""
    optimizers = distributed_optimizers(engine.optimizer)
    for opt in optimizers:
        inner = opt.optimizer  # AdamW makes its moments lazily: give them storage to fill (``state`` is a
        if any(
            "exp_avg" not in inner.state.get(p, {}) for g in inner.param_groups for p in g["params"]
        ):  # defaultdict: reading
            # it, as state_dict() does, leaves empty entries, so test the keys
            opt._init_optimizer_states_with_dummy_values()
    local = {k: v.to_local() for k, v in loaded["model"].items()}
    moments = {key: {k: v[key].to_local() for k, v in loaded["optim"]["state"].items()} for key in MOMENTS}
    step = int(loaded["optim"]["step"])
    with torch.no_grad():
        for name, p in engine.named_model_params():
            master = _join(name, local, engine.shape, engine.tp)
            p.copy_(master.to(p.dtype))
            opt = _optimizer_of(optimizers, p)
            own = _owned(opt, p)
            if own is None:
                continue
            tensors = {"param": master.reshape(-1)[own], "step": torch.tensor(float(step))}
            tensors |= {key: _join(name, moments[key], engine.shape, engine.tp).reshape(-1)[own] for key in MOMENTS}
            opt._set_main_param_and_optimizer_states(p, tensors)
    for opt in optimizers:
        restore_group_step(opt.optimizer, step)
    engine.step_count = int(loaded["steps"])


def restore_group_step(inner: torch.optim.Optimizer, step: int) -> None:
    """Set ``param_groups[i]["step"] = step`` where ``inner`` counts its steps per group, as
    apex's and TransformerEngine's FusedAdam do (mcore picks one when installed): its state
    holds moments without a ``step``. Adam's bias correction ``1 - beta^step`` reads that count,
    so without it a resumed run would restart at step 1. torch's AdamW keeps ``step`` per
    parameter, which ``load_into`` sets with the moments; it is left alone."""
    states = [inner.state[p] for g in inner.param_groups for p in g["params"] if p in inner.state]
    if states and all("step" not in st for st in states):
        for g in inner.param_groups:
            g["step"] = step
