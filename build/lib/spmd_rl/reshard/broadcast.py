"""Weights from the training side to the generators (``parallel.placement: separated``): the
allgather-swap gather, sent instead of loaded.

Every training rank takes part in the gather (``Resharder.full_weights``, collective over the
training mesh, shards cast to the generation dtype first); the training leader broadcasts on
the sync group (leader + every generator, ``distributed.sides``):

1. the header: an int64 length, then UTF-8 JSON ``{"version", "tensors": [[name, dtype, shape]]}``;
2. the tensors in header order, packed into flat uint8 buckets of at most
   ``reshard.bucket_bytes`` (a tensor larger than that is a bucket of its own). Both sides cut
   the buckets from the header with ``buckets``, so no size travels twice.

No pickle: the receiver rebuilds each tensor from its header entry and its bytes. Invariants
(tested): the received tensors equal the gathered ones bit for bit, i.e. their ``digest`` is
the same; the receiver yields a bucket's tensors before it receives the next bucket, so a
generator never holds more than one bucket of the model.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist

DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64)}


def buckets(sizes: list[int], limit: int) -> list[range]:
    """Consecutive tensor positions per bucket: a bucket closes before the tensor that would
    take it over ``limit`` bytes."""
    out, start, total = [], 0, 0
    for k, n in enumerate(sizes):
        if k > start and total + n > limit:
            out.append(range(start, k))
            start, total = k, 0
        total += n
    if start < len(sizes):
        out.append(range(start, len(sizes)))
    return out


def digest(tensors: Iterable[torch.Tensor]) -> str:
    """SHA-256 of the tensors' bytes in order (the bit-for-bit check of a published version)."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(_bytes(t).numpy().tobytes())
    return h.hexdigest()


def hashed(tensors: Iterator[tuple[str, torch.Tensor]], h) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass ``tensors`` through, feeding their bytes to ``h`` (``h.hexdigest()`` at the end
    equals ``digest`` of the same tensors) without holding them."""
    for name, t in tensors:
        h.update(_bytes(t).numpy().data)
        yield name, t


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().cpu().view(-1).view(torch.uint8)


def _nbytes(dtype: str, shape: list[int]) -> int:
    return DTYPES[dtype].itemsize * int(torch.Size(shape).numel())


def send(
    version: int,
    meta: list[tuple[str, torch.dtype, list[int]]],
    weights: Iterator[tuple[str, torch.Tensor]],
    limit: int,
    src: int,
    group,
    device: torch.device,
    leader: bool,
) -> str | None:
    """Training side: consume ``weights`` (every training rank must, the gathers are
    collective); the leader broadcasts them. ``meta`` gives each tensor's (name, dtype, global
    shape) in iteration order. Returns the leader's digest of what it sent."""
    header = {"version": version, "tensors": [[n, str(d).removeprefix("torch."), list(s)] for n, d, s in meta]}
    plan = buckets([_nbytes(d, s) for _, d, s in header["tensors"]], limit)
    if leader:
        raw = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8)
        dist.broadcast(torch.tensor([raw.numel()], dtype=torch.int64, device=device), src=src, group=group)
        dist.broadcast(raw.to(device), src=src, group=group)
    h = hashlib.sha256()
    for span in plan:
        got = [next(weights) for _ in span]
        if not leader:
            continue
        for (name, t), k in zip(got, span):
            if name != meta[k][0] or list(t.shape) != list(meta[k][2]):
                raise RuntimeError(
                    f"weight {k} is {name} {list(t.shape)}, the header announced {meta[k][0]} {meta[k][2]}"
                )
        flat = torch.cat([_bytes(t) for _, t in got])
        h.update(flat.numpy().tobytes())
        dist.broadcast(flat.to(device), src=src, group=group)
    return h.hexdigest() if leader else None


def receive(
    limit: int, src: int, group, device: torch.device
) -> tuple[int, list[tuple[str, torch.dtype, list[int]]], Iterator[tuple[str, torch.Tensor]]]:
    """Generator side: (version, [(name, dtype, shape)], tensors) of the next published policy.
    The header is received here; the tensors arrive lazily, one bucket per step of the
    iterator, so at most one bucket is held on the host. Each bucket is a collective: the caller
    must consume the iterator to its end."""
    size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(size, src=src, group=group)
    raw = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(raw, src=src, group=group)
    header = json.loads(raw.cpu().numpy().tobytes().decode())
    entries = header["tensors"]
    meta = [(name, DTYPES[dtype], list(shape)) for name, dtype, shape in entries]
    return int(header["version"]), meta, _tensors(entries, limit, src, group, device)


def _tensors(entries: list, limit: int, src: int, group, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    for span in buckets([_nbytes(d, s) for _, d, s in entries], limit):
        flat = torch.empty(sum(_nbytes(*entries[k][1:]) for k in span), dtype=torch.uint8, device=device)
        dist.broadcast(flat, src=src, group=group)
        flat, at = flat.cpu(), 0
        for k in span:
            name, dtype, shape = entries[k]
            n = _nbytes(dtype, shape)
            part = flat[at : at + n]
            if at % DTYPES[dtype].itemsize:  # misaligned for its dtype (after an odd-length 16-bit tensor): copy
                part = part.clone()
            yield name, part.view(DTYPES[dtype]).view(shape)  # else a view into the bucket
            at += n
        del flat  # before the next bucket is allocated
