"""megatron-core 0.16.1 on a CPU-only torch (gloo): the few places where mcore assumes CUDA.

Applied once per process by :func:`apply`, and only when the device is CPU; nothing here but
patch 5 runs on cuda or npu. Each patch names what it replaces and why:

1. ``get_default_causal_mask`` (``transformer/utils.py``, imported by name into
   ``fusions/fused_softmax.py``) builds its mask with ``device="cuda"``: rebuilt on the CPU.
2. ``torch.cuda.current_device()`` (rotary embedding, TP layers and mappings, grad buffers, p2p)
   is used as a device: it answers ``cpu``.
3. ``torch.cuda.synchronize`` (p2p after batched send/recv) does nothing on the CPU.
4. The RNG tracker (``tensor_parallel.random``) forks a CUDA generator around attention and
   dropout, and its ``add`` reads ``torch.cuda.get_rng_state``: mcore's own inference tracker
   (no-op forks; dropout draws from the CPU generator) replaces it, and activation recompute
   saves and restores the CPU generator's state instead of a CUDA one.
5. ``WrappedTorchNorm`` (the local spec's RMSNorm) refuses sequence parallel: it is built with
   the flag off and its parameters are tagged ``sequence_parallel``, so that
   ``finalize_model_grads`` sums their gradients over TP as it does for TE's norms. This one is
   not about the CPU: the local spec uses that norm wherever TransformerEngine is absent, so
   :func:`apply_norm_sequence_parallel` applies it on every device (when it was part of
   :func:`apply`, every TP + SP build on a GPU failed at that assert).
6. The pipeline schedules count tokens in ``torch.zeros([], device="cuda")``: their module's
   ``torch`` is a proxy whose ``zeros`` puts a "cuda" tensor on the CPU (a mode around every
   forward and backward, as below, costs a Python call per torch function).
7. The MoE all-to-all token dispatcher (``moe/token_dispatcher.py``) creates a
   ``torch.cuda.Stream`` and copies its split sizes device-to-host on it: its module's ``torch``
   is a proxy whose ``cuda`` has a stream that does nothing, and ``maybe_move_tensor_to_cpu``
   (a no-op for CPU tensors, which left the split sizes as tensors where the all-to-all wants
   lists) returns them as numpy arrays when asked to.

:func:`apply_without_te` is not about the CPU: without TransformerEngine, ``moe_utils`` never
defines ``te_general_gemm`` yet reads it in the router's gating (a ``NameError`` on any device);
it is defined as None there, which selects mcore's own ``torch.mm`` path.

:func:`cuda_as_cpu` is a ``TorchFunctionMode`` for the calls that go through mcore's
optimizer and grad clipping: ``device="cuda"`` literals become the CPU,
``Tensor.type()`` reports ``torch.cuda.*Tensor`` for the dtype asserts of ``clip_grads`` and
``DistributedOptimizer``, and ``Tensor.cuda()`` is the identity. On devices it is a no-op.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_CUDA_TYPE = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}
_applied = False
_norm_applied = False


def _is_cuda(device) -> bool:
    return (isinstance(device, str) and device.startswith("cuda")) or (
        isinstance(device, torch.device) and device.type == "cuda"
    )


class _CudaAsCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CUDA_TYPE.get(name, name)
        if func is torch.Tensor.cuda:
            return args[0]
        return func(*args, **kwargs)


def cuda_as_cpu(device: torch.device):
    """The mode above on the CPU; nothing on a device."""
    return _CudaAsCpu() if device.type == "cpu" else contextlib.nullcontext()


def apply_without_te() -> None:
    """Define ``moe_utils.te_general_gemm`` as None when TransformerEngine is absent."""
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def apply_norm_sequence_parallel() -> None:
    """Patch 5 (module docstring), once, on every device."""
    global _norm_applied
    if _norm_applied:
        return
    _norm_applied = True
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    build = WrappedTorchNorm.__new__

    def norm_with_sp(cls, config, hidden_size, eps=1e-5, *args, **kwargs):
        sp, config.sequence_parallel = config.sequence_parallel, False
        try:
            norm = build(cls, config, hidden_size, eps, *args, **kwargs)
        finally:
            config.sequence_parallel = sp
        for p in norm.parameters():
            p.sequence_parallel = sp
        return norm

    WrappedTorchNorm.__new__ = staticmethod(norm_with_sp)


def apply(device: torch.device) -> None:
    """Apply patches 1-4, 6 and 7 (module docstring) once, on the CPU only."""
    global _applied
    if device.type != "cpu" or _applied:
        return
    _applied = True
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.pipeline_parallel.schedules as schedules
    from megatron.core.tensor_parallel import random as tp_random

    fused_softmax.get_default_causal_mask = lambda sq: torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *a, **k: None
    tp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    tp_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    tp_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    schedules.torch = _CpuZeros()
    token_dispatcher.torch = _CpuStreams()
    to_host = moe_utils.maybe_move_tensor_to_cpu

    def split_sizes_to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return to_host(tensor, as_numpy, record_stream)

    moe_utils.maybe_move_tensor_to_cpu = token_dispatcher.maybe_move_tensor_to_cpu = split_sizes_to_host


class _CpuZeros:
    """``torch`` for ``pipeline_parallel.schedules``: the same module, but ``zeros`` on the CPU."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device=None if _is_cuda(device) else device, **kwargs)


class _NoStream:
    """A CUDA stream's interface where there is nothing to order: the CPU runs in program order."""

    def wait_stream(self, other) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self) -> "_NoStream":  # an event of it: synchronize() does nothing either
        return self

    def __eq__(self, other) -> bool:
        return isinstance(other, _NoStream)

    __hash__ = object.__hash__


class _CpuCuda:
    """``torch.cuda`` for ``moe.token_dispatcher``: streams that do nothing, the rest torch's."""

    _stream = _NoStream()

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    def Stream(self, *args, **kwargs) -> _NoStream:  # noqa: N802  (torch's name)
        return self._stream

    def current_stream(self, *args, **kwargs) -> _NoStream:
        return self._stream

    def stream(self, _stream):
        return contextlib.nullcontext()


class _CpuStreams:
    """``torch`` for ``moe.token_dispatcher``: the same module with ``cuda`` as above."""

    cuda = _CpuCuda()

    def __getattr__(self, name):
        return getattr(torch, name)
