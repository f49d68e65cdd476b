"""One optimizer step of a model that every replica holds whole, whatever the replicas are now.

The global batch stays the same when replicas come and go; only its split changes. Each replica
computes the *sum* of its samples' gradients; one all-reduce (SUM) over the replicas and a
division by the global batch size give the batch mean on every member, exactly as one replica
holding the whole batch would compute it, up to the summation order (float round-off):

    g = (1 / B) * sum_r sum_{i in share_r} grad l_i        (share_r = {i : i mod world = rank_r})

The optimizer steps only when ``should_commit`` says every member got through the all-reduce
(torchft's ``OptimizerWrapper``: no step on a partial gradient). A failure raises
``ReplicaLost`` before any state changed, so the caller recovers (``ReplicaGroup.recover`` with
``state_tensors``, which heals a joiner) and redoes the same step. Every member applies the same
reduced bytes, so after a heal the replicas stay bit-identical.

Inside a replica the model may be sharded (FSDP2 over the replica's ranks, gradients summed
inside it: ``set_gradient_divide_factor(1.0)``): each rank then reduces the shard it holds with
the ranks holding the same shard in the other replicas (HSDP, ``ReplicaGroup``'s column
groups), and heals that shard the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch.distributed.tensor import DTensor

from spmd_rl.elastic.replica_group import ReplicaGroup, ReplicaLost


def _local(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank holds (a DTensor's local shard, which aliases it)."""
    return t.to_local() if isinstance(t, DTensor) else t


def materialize(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Give ``optimizer`` its per-parameter state (created at its first step) by one step on
    zero gradients; for a replica about to be healed, which overwrites all of it."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """What a joiner must receive, in one order on every replica: each parameter, then its
    optimizer state tensors by name. ``materialize`` first on a fresh optimizer."""
    out = []
    for p in model.parameters():
        out.append(_local(p.data))
        state = optimizer.state.get(p, {})
        out += [_local(state[k]) for k in sorted(state) if isinstance(state[k], torch.Tensor)]
    return out


def sum_gradients(group: ReplicaGroup, grads: list[torch.Tensor]) -> None:
    """Sum each gradient over the replicas, in place (each rank its local shard, with the ranks
    holding the same shard in the other replicas): one all-reduce of the flattened shards, kept
    only when every member got through it (``should_commit``); else ``ReplicaLost`` and the
    gradients are unchanged, so no step is taken on a partial sum."""
    local = [_local(g) for g in grads]
    flat = torch.cat([g.reshape(-1) for g in local]) if local else torch.zeros(0)
    group.allreduce(flat)
    if not group.should_commit(True):
        raise ReplicaLost(f"generation {group.gen.number}: a member did not get through the gradient's sum")
    offset = 0
    for g in local:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def replicated_step(
    group: ReplicaGroup,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    share_loss: Callable[[int, int], torch.Tensor],
    global_batch: int,
) -> None:
    """``share_loss(rank, world)``: the summed loss of this replica's share of the global
    batch. Raises ``ReplicaLost`` (nothing stepped) when a member is lost (module docstring)."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer.zero_grad(set_to_none=False)
    share_loss(group.rank, group.world).backward()
    sum_gradients(group, [p.grad for p in params])
    for p in params:
        _local(p.grad).div_(global_batch)
    optimizer.step()


def committed_steps(
    group: ReplicaGroup,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    share_loss: Callable[[int, int, int], torch.Tensor],
    global_batch: int,
    counter: torch.Tensor,
    steps: int,
    event: Callable[[str], None] = lambda kind: None,
) -> Iterator[int]:
    """Yield each step ``s < steps`` once it is committed, every replica at the same boundary.
    ``share_loss(s, rank, world)``: step ``s``'s summed loss of this replica's share.
    ``counter`` (a one-element float tensor) is the step count, healed with the weights and the
    optimizer state. At each boundary, replicas waiting to join are taken in (``"grew"``); a lost
    member makes the survivors recover and redo the same step (``"lost"``, ``"recovered"``)."""

    def state() -> list[torch.Tensor]:
        return [counter, *state_tensors(model, optimizer)]

    while int(counter.item()) < steps:
        s = int(counter.item())
        try:
            if group.joiners_waiting():
                group.recover(state)
                event("grew")
                continue  # every member, the joiner too, is at the step boundary again
            replicated_step(group, model, optimizer, lambda r, w: share_loss(s, r, w), global_batch)
        except ReplicaLost:
            event("lost")
            group.recover(state)
            event("recovered")
            continue
        counter += 1
        yield s
