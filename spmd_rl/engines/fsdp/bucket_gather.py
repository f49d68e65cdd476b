"""Full tensors from FSDP2 shards with one all-gather per bucket (not one per parameter).

FSDP2 shards dim 0 of each parameter over the ``dp_shard`` mesh dimension as ``torch.chunk``
does: with W ranks and c = ceil(d0 / W) rows per chunk, rank r holds rows
[r·c, min((r+1)·c, d0)). For a bucket of tensors i = 1..m with s_i elements per row, every
rank writes its shard of each tensor, cast to the generation dtype and zero-padded to c_i rows,
into one flat input of P = Σ c_i·s_i elements. One ``all_gather_into_tensor`` yields W·P
elements, rank-major; tensor i is rows [0, d0_i) of ``out.view(W, P)[:, o_i : o_i + c_i·s_i]``
read as (W·c_i, *row shape). A bucket of one tensor is already in row order and is yielded as
a view; otherwise each tensor is copied out when the consumer asks for it.

Under a 2-D (dp_shard, tp) mesh the dp gather gives the TP-local tensor; its TP shards are then
gathered tensor by tensor (``DTensor.full_tensor`` over the tp dimension).

Temporary bytes of a bucket (``Bucket.temp_elems`` · itemsize): the output W·P, plus the
larger of the input P (freed after the collective; on one rank the input is the output) and the
tensor being copied out (under TP also what ``full_tensor`` over tp allocates). The backend may
still hold a bucket's buffers for a moment after the collective returns (gloo's worker thread
drops its work after waking the caller; NCCL frees on its stream), so two consecutive buckets
can be alive together: ``plan`` keeps each bucket within half of ``reshard.bucket_bytes`` and
``in_flight`` is the bound, two buckets, that holds. A tensor that exceeds half the bound alone
is a bucket of its own. A consumer that holds the last tensor while it asks for the next (a
``for`` loop does) adds that one tensor.

Invariants (tested on two ranks, FSDP and TP): the tensors equal ``full_tensor()`` cast to the
generation dtype bit for bit; one all-gather per bucket over dp; the live bytes the gather
allocates stay within ``in_flight``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor, Replicate, Shard

ALL_GATHER = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
"""The functional all-gather: torch 2.11 (vLLM 0.26's, the GPU images') has only
``all_gather_tensor``, which 2.13 deprecates for ``all_gather_single``."""


def chunk_len(n: int, parts: int, index: int) -> int:
    """Length of ``torch.chunk(range(n), parts)[index]`` (0 past the last chunk)."""
    c = math.ceil(n / parts) if n else 0
    return max(0, min(c, n - index * c))


@dataclass
class Piece:
    """One tensor of a bucket: its TP-local shape and where its rows sit in each rank's input."""

    name: str
    param: torch.Tensor
    local_shape: list[int]
    world: int = 1
    offset: int = 0

    @property
    def row(self) -> int:
        return math.prod(self.local_shape[1:])

    @property
    def chunk_rows(self) -> int:
        return math.ceil(self.local_shape[0] / self.world)

    @property
    def padded(self) -> int:
        """Elements this tensor takes in each rank's flat input."""
        return self.chunk_rows * self.row

    def copy_elems(self, alone: bool) -> int:
        """Elements allocated when it is read out of the gather: the TP-local tensor unless it is
        alone in its bucket (then a view), plus under TP what ``full_tensor`` over tp allocates:
        the gathered tensor, and for a shard on dim > 0 the ``cat`` that reorders it."""
        pl = _tp_placement(self.param)
        tp = 0 if pl is None else self.param.numel() * (1 if pl.dim == 0 else 2)
        return (0 if alone else math.prod(self.local_shape)) + tp


@dataclass
class Bucket:
    pieces: list[Piece] = field(default_factory=list)

    @property
    def flat(self) -> int:
        """P, the elements of each rank's input."""
        return sum(p.padded for p in self.pieces)

    def temp_elems(self) -> int:
        """W·P + max(P, largest copy-out); P is not extra on one rank."""
        if not isinstance(self.pieces[0].param, DTensor):
            return self.pieces[0].param.numel()
        alone, world = len(self.pieces) == 1, self.pieces[0].world
        gather_in = self.flat if world > 1 else 0  # one rank: the input is the output
        return world * self.flat + max(gather_in, max(p.copy_elems(alone) for p in self.pieces))


def _tp_placement(p: torch.Tensor):
    """The placement on the tp mesh dimension of a 2-D parameter, None when there is nothing
    to gather over tp (1-D mesh, tp of size 1 or a replicated tensor)."""
    if not isinstance(p, DTensor) or p.device_mesh.ndim == 1 or p.device_mesh.size(1) == 1:
        return None
    pl = p.placements[1]
    return None if isinstance(pl, Replicate) else pl


def _local_shape(p: DTensor) -> list[int]:
    """Shape after the dp gather: the full shape, or this rank's TP shard of it."""
    shape = list(p.shape)
    pl = _tp_placement(p)
    if pl is not None:
        if not isinstance(pl, Shard):
            raise ValueError(f"cannot gather {pl} over tp: only Shard and Replicate TP placements are supported")
        shape[pl.dim] = chunk_len(shape[pl.dim], p.device_mesh.size(1), p.device_mesh.get_local_rank(1))
    return shape


def _dp(p: DTensor) -> tuple[dist.ProcessGroup, int]:
    if getattr(p.placements[0], "dim", None) != 0:
        raise ValueError(f"expected an FSDP2 parameter sharded on dim 0 over dp_shard, got placements {p.placements}")
    return p.device_mesh.get_group(0), p.device_mesh.get_local_rank(0)


def plan(named: list[tuple[str, torch.Tensor]], itemsize: int, limit: float) -> list[Bucket]:
    """Consecutive buckets, each closed before the tensor that would take its temporary bytes
    (``temp_elems`` · itemsize) over ``limit / 2`` (two buckets may be in flight). Plain
    (non-DTensor) tensors go one per bucket."""
    out: list[Bucket] = []
    cur = Bucket()
    for name, p in named:
        if not isinstance(p, DTensor):
            out += [cur] if cur.pieces else []
            out.append(Bucket([Piece(name, p, list(p.shape))]))
            cur = Bucket()
            continue
        piece = Piece(name, p, _local_shape(p), p.device_mesh.size(0))
        grown = Bucket(cur.pieces + [piece])
        if cur.pieces and grown.temp_elems() * itemsize > limit / 2:
            out.append(cur)
            grown = Bucket([piece])
        piece.offset = grown.flat - piece.padded
        cur = grown
    if cur.pieces:
        out.append(cur)
    return out


def in_flight(buckets: list[Bucket], itemsize: int) -> list[int]:
    """Per bucket, the temporary bytes that may be alive while it is gathered: its own and
    the previous bucket's. Each is at most ``limit`` unless a lone tensor exceeds half of it."""
    temps = [b.temp_elems() * itemsize for b in buckets]
    return [t + (temps[k - 1] if k else 0) for k, t in enumerate(temps)]


def gather(bucket: Bucket, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor in ``dtype``) of each tensor of ``bucket``: one collective over the
    dp group, then per tensor the copy-out and, under TP, the tp gather. Collective: every rank
    of the training mesh iterates every bucket in the same order."""
    first = bucket.pieces[0].param
    if not isinstance(first, DTensor):
        yield bucket.pieces[0].name, first.detach().to(dtype)
        return
    group, rank = _dp(first)
    world = bucket.pieces[0].world
    flat_in = torch.zeros(bucket.flat, dtype=dtype, device=first.device)
    for piece in bucket.pieces:
        shard = piece.param.to_local().detach()
        rows = chunk_len(piece.local_shape[0], world, rank)
        if shard.shape[0] != rows:
            raise ValueError(f"{piece.name}: local shard has {shard.shape[0]} rows, torch.chunk layout expects {rows}")
        flat_in[piece.offset : piece.offset + shard.numel()].view(shard.shape).copy_(shard)
    # functional all-gather, waited here: the backend holds no buffer of this bucket past the wait
    out = flat_in if world == 1 else funcol.wait_tensor(ALL_GATHER(flat_in, 0, group))
    del flat_in
    ranks = out.view(world, bucket.flat)
    for piece in bucket.pieces:
        c, d0, rest = piece.chunk_rows, piece.local_shape[0], piece.local_shape[1:]
        if len(bucket.pieces) == 1:  # rank-major is row order: a view
            local = ranks.view(world * c, *rest)[:d0]
        else:
            local = torch.empty(piece.local_shape, dtype=dtype, device=first.device)
            for r in range(world):
                n = chunk_len(d0, world, r)
                local[r * c : r * c + n] = ranks[r, piece.offset : piece.offset + n * piece.row].view(n, *rest)
        pl = _tp_placement(piece.param)
        if pl is not None:
            p = piece.param
            local = DTensor.from_local(local, p.device_mesh["tp"], [pl], shape=p.shape, stride=p.stride()).full_tensor()
        yield piece.name, local
