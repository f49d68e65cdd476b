"""The dock as every stage sees it: put / get / iteration start and commit.

Distributed mode: a rank puts into its own node's warehouse (served by the node's local-rank-0
process) and publishes one put-record in etcd; a stage's get waits for its inputs through its
controller, takes its DP group's share of the split, and fetches each (column, index) from the
warehouse that holds it: its own node's in process (the serving rank, ``dock.local``) or
through shared memory (the node's other ranks, ``dock.same_node``). Centralized mode (the paper's replay-buffer
baseline): rank 0 serves the only warehouse and every put and get goes through it.

Within a DP group every TP rank computes the same split. Its remote part is fetched once, by
the group's TP leader, and relayed to the TP ranks on the leader's node through their node's
warehouse (``dock.relay``) when it is big enough to pay; otherwise every TP rank fetches its own.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDict

from spmd_rl.config.layout import Layout
from spmd_rl.config.schema import DockConfig
from spmd_rl.dock.auth import job_key
from spmd_rl.dock.batch import DockBatch
from spmd_rl.dock.fetch import Fetcher, Peer
from spmd_rl.dock.columns import ColumnSpec, as_samples
from spmd_rl.dock.controller import StageController, group_nodes
from spmd_rl.dock.errors import DockRequestError
from spmd_rl.dock.feed import RecordFeed, RecordView
from spmd_rl.dock.feed_host import FeedHost
from spmd_rl.dock.heartbeat import PeerWatch
from spmd_rl.dock.metadata import MetadataStore
from spmd_rl.dock.node_feed import NodeFeed
from spmd_rl.dock.node_lease import NodeLease, RankBeat
from spmd_rl.dock.presence import presence_name
from spmd_rl.dock.records import Locations, PutRecord
from spmd_rl.dock.relay import plan_relay, relayed_fetch
from spmd_rl.dock.stream import StageStream
from spmd_rl.dock.warehouse import WarehouseServer

log = logging.getLogger(__name__)


class TransferDock(Fetcher):
    """The dock on this rank: its warehouse (when it serves one), liveness, puts, gets and
    streams, commits (``Fetcher`` holds the fetch primitives)."""

    def __init__(
        self,
        cfg: DockConfig,
        meta: MetadataStore,
        specs: dict[str, ColumnSpec],
        peer: Peer,
        token: str,
        in_process: bool = True,
    ):
        """``in_process``: see ``Fetcher``."""
        super().__init__(cfg, meta, specs, peer, token, in_process)
        self._num_samples: dict[int, int] = {}
        self._feeds: dict[int, RecordView] = {}
        """Per iteration, the record feed this rank follows itself (the serving rank reads its
        warehouse's, ``dock.feed_host``)."""
        self._own: dict[int, Locations] = {}
        """Per iteration, this rank's put-records (its feed may not have seen them yet)."""
        self._seq = 0

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self, heartbeat_ttl_s: int | None = None) -> "TransferDock":
        """Start this node's warehouse (if this rank serves it) and publish its address; with
        ``heartbeat_ttl_s`` also the liveness keys (stages then fail fast on a lost rank): the
        node's lease on its local rank 0, a beat on the others (``dock.node_lease``)."""
        if self.serves_warehouse():
            port = self.cfg.port + self.peer.node if self.cfg.port else 0
            self.server = WarehouseServer(
                self.cfg.interface,
                port,
                self.token,
                self.cfg.bucket_bytes,
                self.cfg.max_message_bytes,
                self.cfg.buffer_pool_bytes,
            )
            if not self.centralized:
                self.server.keep_feeds(FeedHost(self.meta, source=self._records_source()))
            self.server.start()
            self.meta.put(
                self.meta.key("warehouses", self.peer.node), json.dumps({"address": self.server.address}).encode()
            )
            log.info("rank %d serves warehouse of node %d at %s", self.peer.rank, self.peer.node, self.server.address)
        if heartbeat_ttl_s:
            self.heartbeat = self._liveness(heartbeat_ttl_s).start()
        return self

    def _liveness(self, ttl_s: int) -> NodeLease | RankBeat:
        """This rank's part of its node's liveness keys: the node's lease on local rank 0 (with
        its warehouse's key when it serves one), a beat on the lead's board elsewhere."""
        k, node, name = self.peer.nproc_per_node, self.peer.node, presence_name(job_key(self.token))
        if self.peer.local_rank == 0:
            served = self.server is not None
            return NodeLease(
                self.meta,
                node,
                range(node * k, (node + 1) * k),
                ttl_s,
                name,
                warehouse=self.home_node if served else None,
                healthy=self.server.serving if served else None,
            )
        return RankBeat(self.meta, node, self.peer.rank, self.peer.local_rank, ttl_s, self.cfg.get_timeout_s, name)

    def _records_source(self) -> Callable[[int], RecordView] | None:
        """Where this node's warehouse learns an iteration's put-records: etcd (None) on the
        first node of its group of ``dock.records_group_nodes``, the group's first node's
        warehouse elsewhere (``dock.feed_host``)."""
        first = self.peer.node - self.peer.node % self.cfg.records_group_nodes
        if first == self.peer.node:
            return None
        address: list[str] = []

        def source(iteration: int) -> NodeFeed:
            if not address:  # looked up once, when the first feed opens (the warehouse may start later)
                address.append(self.warehouse_address(first))
            alive = (lambda: self.warehouse_alive(first)) if self.heartbeat is not None else None
            return NodeFeed(
                address[0],
                self.token,
                iteration,
                self.cfg.get_timeout_s,
                name=f"warehouse of node {first}",
                alive=alive,
            )

        return source

    def warehouse_nodes(self) -> list[int]:
        """Nodes that serve a warehouse in this world."""
        return [0] if self.centralized else list(range(self.peer.world // self.peer.nproc_per_node))

    def watch_peers(self, on_lost: Callable[[str], None]) -> None:
        """Call ``on_lost(reason)`` (from a background thread) once any rank or warehouse of
        the world loses its liveness key; needs ``start(heartbeat_ttl_s)``. Arm it only after
        every rank has started (a barrier after ``start``)."""
        if self.heartbeat is None:
            raise DockRequestError("watch_peers needs liveness keys: start the dock with heartbeat_ttl_s")
        self.peer_watch = PeerWatch(self.meta, self.peer.world, self.warehouse_nodes(), on_lost).start()

    def close(self) -> None:
        for beat in (self.peer_watch, self.heartbeat):
            if beat is not None:
                beat.stop()
        for feed in self._feeds.values():
            feed.stop()
        self._feeds.clear()
        for c in self._clients.values():
            c.close()
        self._clients.clear()
        if self.server is not None:
            self.server.stop()
            self.server = None

    def begin_iteration(self, iteration: int, num_samples: int) -> None:
        """Every rank declares the iteration's sample count G x N (indices 0..num_samples-1)."""
        self._num_samples[iteration] = num_samples

    def commit(self, iteration: int, alone: bool = False) -> None:
        """Free the iteration: each warehouse owner drops its data, rank 0 deletes the metadata.
        Call on every rank after all ranks finished reading (e.g. after a barrier). ``alone``:
        this rank is the only one committing (separated placement's training leader; the other
        ranks ``release``), so it drops the iteration on every warehouse itself."""
        for node in self.warehouse_nodes() if alone else [self.home_node] if self.server is not None else []:
            self.client(node).drop(iteration)
        if alone or self.peer.rank == 0:
            self.meta.delete_prefix(self.meta.key(iteration) + "/")
        self.release(iteration)

    def release(self, iteration: int) -> None:
        """Forget this rank's local state of the iteration (its sample count, its watch); the
        data stays until a ``commit``."""
        self._num_samples.pop(iteration, None)
        self._own.pop(iteration, None)
        self.relay_calls.pop(iteration, None)
        if (feed := self._feeds.pop(iteration, None)) is not None:
            feed.stop()

    # -- sample flow ----------------------------------------------------------------------------
    def put(
        self, stage: str, iteration: int, data: Mapping[str, Any] | TensorDict, indices: Sequence[int] | torch.Tensor
    ) -> None:
        """Store columns for ``indices`` in this node's warehouse and publish the put-record.
        Refused puts (unknown column, bad index, dtype/shape, duplicate) change nothing."""
        idx = [int(i) for i in (indices.tolist() if isinstance(indices, torch.Tensor) else indices)]
        if iteration not in self._num_samples:
            raise DockRequestError(
                f"iteration {iteration} not started: call begin_iteration({iteration}, num_samples) first"
            )
        limit = self._num_samples[iteration]
        out_of_range = [i for i in idx if not 0 <= i < limit]
        if out_of_range:
            raise DockRequestError(f"indices {out_of_range[:8]} out of range [0, {limit}) for iteration {iteration}")
        if len(set(idx)) != len(idx):
            raise DockRequestError("indices of one put must be distinct")
        columns: dict[str, list[torch.Tensor]] = {}
        for name, value in data.items():
            if name not in self.specs:
                raise DockRequestError(f"unknown column {name!r}; known columns: {', '.join(sorted(self.specs))}")
            columns[name] = as_samples(name, value, len(idx), self.specs[name])
        self._refuse_duplicates(iteration, columns, idx)
        ragged = {n: self.specs[n].ragged for n in columns}
        client = self.client(self.home_node)
        client.put(iteration, idx, columns, ragged)
        record = PutRecord(
            stage,
            self.peer.rank,
            self.home_node,
            list(columns),
            idx,
            {n: [v.numel() for v in vals] for n, vals in columns.items() if ragged[n]},
        )
        self._seq += 1
        key = self.meta.key(iteration, "puts", f"{self.peer.rank:06d}-{self._seq:08d}")
        try:
            self.meta.put(key, record.encode())
        except Exception:
            client.delete(iteration, idx, list(columns))
            raise
        self._own.setdefault(iteration, Locations()).add(record)

    def _refuse_duplicates(self, iteration: int, columns: Mapping[str, object], idx: list[int]) -> None:
        """DockRequestError for a (column, index) already written: by another rank as far as
        this rank's record feed has seen, or by this rank (its feed may lag its own puts)."""
        feed, own = self.feed(iteration), self._own.get(iteration, Locations())
        for name in columns:
            dup = [i for i in idx if feed.written(name, i) or own.has(name, i)]
            if dup:
                writer = feed.written(name, dup[0]) or own.writer[name][dup[0]]
                raise DockRequestError(
                    f"column {name!r} already written for indices {dup[:8]} by {writer}: duplicate put"
                )

    def get(
        self,
        stage: str,
        iteration: int,
        columns: Sequence[str],
        layout: Layout,
        group_size: int = 1,
        expected: Sequence[int] | None = None,
        timeout_s: float | None = None,
        parts: int = 1,
    ) -> DockBatch:
        """This rank's DP group's share of ``expected`` (default: all indices) once every index
        has all ``columns``. ``layout`` is the stage's (dp, tp) layout over the world; with
        ``parts``, each of ``expected``'s equal consecutive parts is shared out on its own
        (``controller.split``)."""
        self._check_known(columns)
        if iteration not in self._num_samples:
            raise DockRequestError(f"iteration {iteration} not started: call begin_iteration first")
        want = list(range(self._num_samples[iteration])) if expected is None else [int(i) for i in expected]
        ctl = StageController(
            self.feed(iteration), stage, self.specs, lost_ranks=self.lost_ranks if self.heartbeat else None
        )
        plan = ctl.plan(
            iteration,
            columns,
            want,
            group_nodes(layout, self.peer.nproc_per_node),
            group_size,
            timeout_s or self.cfg.get_timeout_s,
            parts,
        )
        return self.batch_of(
            iteration, plan.groups[layout.coords(self.peer.rank)[0]], list(columns), plan.locations, (stage, layout)
        )

    def stream(
        self,
        stage: str,
        iteration: int,
        columns: Sequence[str],
        layout: Layout,
        expected: Sequence[int],
        group_size: int = 1,
        units_per_group: int = 1,
    ) -> StageStream:
        """Like ``get``, in waves as the inputs become ready (``dock.stream``). The iteration's
        streams share one watch of its put-records, closed by ``commit``."""
        self._check_known(columns)
        return StageStream(
            self, self.feed(iteration), stage, iteration, columns, layout, expected, group_size, units_per_group
        )

    def feed(self, iteration: int) -> RecordView:
        """The iteration's put-records as this rank sees them (``dock.feed``), opened on first
        use: the warehouse's own feed on the rank that serves it (closed when the iteration is
        dropped), the warehouse's through a ``NodeFeed`` on the node's other ranks, a feed of
        its own from etcd in the centralized dock and off the in-process path (both closed by
        ``release``)."""
        if self.server is not None and self.server.feeds is not None:
            return self.server.feeds.open(iteration)
        if iteration not in self._feeds:
            if self.centralized or not self.in_process:
                self._feeds[iteration] = RecordFeed(self.meta, iteration)
            else:
                home = self.client(self.home_node)
                self._feeds[iteration] = NodeFeed(
                    home.address,
                    self.token,
                    iteration,
                    self.cfg.get_timeout_s,
                    name=f"warehouse of node {self.home_node}",
                )
        return self._feeds[iteration]

    def _check_known(self, columns: Sequence[str]) -> None:
        unknown = [c for c in columns if c not in self.specs]
        if unknown:
            raise DockRequestError(f"unknown column(s) {unknown}; known columns: {', '.join(sorted(self.specs))}")

    def batch_of(
        self,
        iteration: int,
        indices: list[int],
        columns: list[str],
        loc: Locations,
        relay: tuple[str, Layout] | None = None,
    ) -> DockBatch:
        """Fetch ``columns`` of ``indices`` from the warehouses that hold them. ``relay``: (stage,
        layout) of a blocking get whose TP ranks all make the same call, so the TP leader may
        fetch the remote part for them (``dock.relay``); a streamed wave passes None, because a
        rank polling between generation steps must never wait for another rank's fetch."""
        plan = plan_relay(self, relay[0], iteration, relay[1], indices, columns, loc) if relay else None
        if plan is None:
            return self.plain_batch(iteration, indices, columns, loc)
        return self.as_batch(indices, relayed_fetch(self, iteration, indices, columns, loc, plan))

    def warehouse_stats(self) -> dict[str, Any] | None:
        return self.client(self.home_node).stats() if self.server is not None else None
