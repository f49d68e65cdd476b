"""TP leader fetch: one copy of a DP group's remote inputs crosses the network, not one per TP rank.

Every TP rank of a DP group needs the same share. Fetched independently, the part of it held on
other nodes crosses the network once per TP rank on the group's node (t times for TP t, since a
TP group never spans nodes when t divides the ranks per node). With the relay, the group's leader
(TP rank 0) fetches the share's remote part first, puts it into its own node's warehouse under
relay columns ``relay/<stage>/<call>/<dp>/<column>``, creates the etcd key
``/<job>/<iteration>/relay/<stage>/<call>/<dp>``, then fetches its local part; meanwhile the TP
ranks on its node fetch their local part as before and, once the key exists, the remote part
from their own node's warehouse, through shared memory (``dock.same_node``) or in process. ``commit`` frees relay
columns and keys with the iteration.

The relay runs only where it can pay: TP > 1, distributed mode, at least one other TP rank on
the leader's node, and at least ``dock.tp_relay_min_bytes`` of the share held on other nodes
(waiting for the leader costs an etcd round trip). Every rank decides from the same put-records,
so the group agrees without a message. ``<call>`` counts this stage's relayed fetches in the
iteration; every rank of the group makes the same blocking gets in the same order (SPMD), so
the names agree too. Only a blocking ``get`` relays: a streamed wave (``dock.stream``) is
fetched by each rank itself, because stage fusion polls between generation steps, where a TP
peer may be inside a collective with the polling rank and a wait for the leader could deadlock.

Invariants (``tests/integration/test_dock_relay.py``): the samples each TP rank receives are the ones it
would fetch itself, bit for bit; each remote byte of the share leaves its warehouse once per
DP group instead of once per TP rank; a TP rank waiting for a leader whose heartbeat expired
fails at once (``DockUnavailable``) instead of waiting ``dock.get_timeout_s``; a poll never
waits for the leader.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from spmd_rl.config.layout import Layout
from spmd_rl.dock.controller import fail_if_ranks_lost
from spmd_rl.dock.errors import DockTimeout
from spmd_rl.dock.records import Locations

if TYPE_CHECKING:
    from spmd_rl.dock.fetch import Fetcher

log = logging.getLogger(__name__)
_LIVENESS_EVERY_S = 1.0


@dataclass(frozen=True)
class Relay:
    name: str
    """``relay/<stage>/<call>/<dp>``: the prefix of the relay columns and the etcd key's suffix."""
    leader: bool
    remote: tuple[int, ...]
    """Positions, in the share, of the samples with an input on another node than the leader's."""
    sizes: tuple[int, ...]
    """Payload bytes of each of those samples' ``columns`` (the leader's fetch buckets)."""


def sample_bytes(dock: "Fetcher", loc: Locations, columns: Sequence[str], indices: Sequence[int]) -> list[int]:
    """Payload bytes of ``columns`` of each of ``indices``, from the put-records."""
    out = [0] * len(indices)
    for c in columns:
        spec = dock.specs[c]
        item = torch.empty(0, dtype=spec.dtype).element_size()
        per = loc.length.get(c, {})
        fixed = max(1, int(torch.Size(spec.shape).numel()))
        for k, i in enumerate(indices):
            out[k] += item * (per.get(i, 0) if spec.ragged else fixed)
    return out


def plan_relay(
    dock: "Fetcher",
    stage: str,
    iteration: int,
    layout: Layout,
    indices: Sequence[int],
    columns: Sequence[str],
    loc: Locations,
) -> Relay | None:
    """The relay of this rank's fetch of ``indices``, or None where it does not pay (module)."""
    threshold, npn = dock.cfg.tp_relay_min_bytes, dock.peer.nproc_per_node
    if threshold is None or layout.group == 1 or dock.centralized or not indices:
        return None
    dp, _ = layout.coords(dock.peer.rank)
    leader = layout.dp_group_leader(dp)
    node = leader // npn
    if dock.peer.node != node or sum(r // npn == node for r in range(leader, leader + layout.group)) < 2:
        return None
    remote = tuple(k for k, i in enumerate(indices) if any(loc.node[c][i] != node for c in columns))
    sizes = tuple(sample_bytes(dock, loc, columns, [indices[k] for k in remote]))
    if not remote or sum(sizes) < threshold:
        return None
    calls = dock.relay_calls.setdefault(iteration, {})
    calls[stage] = call = calls.get(stage, -1) + 1
    return Relay(f"relay/{stage}/{call}/{dp}", dock.peer.rank == leader, remote, sizes)


def relayed_fetch(
    dock: "Fetcher", iteration: int, indices: list[int], columns: list[str], loc: Locations, relay: Relay
) -> dict[str, list[torch.Tensor]]:
    """The leader fetches the remote part first and stores it on its node, then its local part;
    the other TP ranks there fetch their local part meanwhile, then the relayed one."""
    home = dock.client(dock.peer.node)
    names = {c: f"{relay.name}/{c}" for c in columns}
    remote = set(relay.remote)
    local = [k for k in range(len(indices)) if k not in remote]
    out: dict[str, list[torch.Tensor | None]] = {c: [None] * len(indices) for c in columns}

    def place(
        positions: Sequence[int], got: dict[str, list[torch.Tensor]], rename: dict[str, str] | None = None
    ) -> None:
        for c in columns:
            for k, v in zip(positions, got[rename[c] if rename else c]):
                out[c][k] = v

    key = dock.meta.key(iteration, relay.name)
    if relay.leader:
        for a, b in _chunks(relay.sizes, dock.cfg.bucket_bytes):
            part = relay.remote[a:b]
            got = dock.fetch(iteration, [indices[k] for k in part], columns, loc)
            home.put(
                iteration,
                [indices[k] for k in part],
                {names[c]: got[c] for c in columns},
                {names[c]: dock.specs[c].ragged for c in columns},
            )
            place(part, got)
        dock.meta.put(key, b"1")
    if local:
        place(local, dock.fetch(iteration, [indices[k] for k in local], columns, loc))
    if not relay.leader:
        _wait_for_leader(dock, key, iteration)
        place(relay.remote, home.get(iteration, [indices[k] for k in relay.remote], list(names.values())), names)
    return out  # type: ignore[return-value]


def _chunks(sizes: Sequence[int], bucket_bytes: int) -> list[tuple[int, int]]:
    """Runs [a, b) of ``sizes`` of at most ``bucket_bytes`` each (one sample may exceed it)."""
    runs, start, acc = [], 0, 0
    for j, b in enumerate(sizes):
        if j > start and acc + b > bucket_bytes:
            runs.append((start, j))
            start, acc = j, 0
        acc += b
    return runs + [(start, len(sizes))]


def _wait_for_leader(dock: "Fetcher", key: str, iteration: int) -> None:
    """Until the leader's key exists: an etcd watch from the read that missed it (no polling),
    with a look at the ranks' heartbeats and at the key itself every ``_LIVENESS_EVERY_S``."""
    revision, kvs = dock.meta.get_prefix_at(key)
    if any(k == key for k, _, _ in kvs):
        return
    arrived = threading.Event()
    events, cancel = dock.meta.watch_prefix(key, start_revision=revision + 1)

    def pump() -> None:
        try:
            for ev in events:
                if ev["kv"]["key"].decode() == key:
                    break
        except Exception as exc:  # noqa: BLE001 - a broken watch: the loop below still reads the key
            log.debug("relay watch of %s ended: %s", key, exc)
        arrived.set()

    threading.Thread(target=pump, name="dock-relay-watch", daemon=True).start()
    deadline = time.monotonic() + dock.cfg.get_timeout_s
    try:
        while True:
            woke = arrived.wait(_LIVENESS_EVERY_S)
            if dock.meta.get(key) is not None:
                return
            if woke:  # the watch ended without the key (a broken watch): a look a second from now on
                arrived.clear()
            if dock.heartbeat is not None:
                fail_if_ranks_lost(
                    dock.lost_ranks, f"relay {key}", f"waiting for the TP leader in iteration {iteration}"
                )
            if time.monotonic() > deadline:
                raise DockTimeout(
                    f"the TP leader did not relay {key} within dock.get_timeout_s={dock.cfg.get_timeout_s:.0f}s"
                )
    finally:
        cancel()
