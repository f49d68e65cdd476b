"""The fetch primitives of the dock: where this rank sits (``Peer``), its connections to the
warehouses (in process, same-node shared memory, or the wire) and the fetch of columns of
samples from the nodes that hold them. ``dock.relay`` (the TP leader fetch), ``dock.stream``
(streamed waves) and ``dock.client`` (the dock itself, a ``Fetcher``) all build on this module;
it imports none of them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from spmd_rl.config.schema import DockConfig
from spmd_rl.dock.batch import DockBatch
from spmd_rl.dock.columns import ColumnSpec
from spmd_rl.dock.errors import DockTimeout
from spmd_rl.dock.heartbeat import PeerWatch, alive_ranks
from spmd_rl.dock.local import InProcessWarehouse
from spmd_rl.dock.metadata import MetadataStore
from spmd_rl.dock.node_lease import NodeLease, RankBeat
from spmd_rl.dock.records import Locations
from spmd_rl.dock.same_node import SameNodeWarehouse
from spmd_rl.dock.warehouse import WarehouseServer
from spmd_rl.dock.warehouse_client import WarehouseClient


@dataclass(frozen=True)
class Peer:
    """Where this process sits: global rank, node index, rank within the node."""

    rank: int
    world: int
    node: int
    local_rank: int
    nproc_per_node: int


class Fetcher:
    """Connections to the warehouses and the fetch of samples from them."""

    def __init__(
        self,
        cfg: DockConfig,
        meta: MetadataStore,
        specs: dict[str, ColumnSpec],
        peer: Peer,
        token: str,
        in_process: bool = True,
    ):
        """``in_process``: reach this node's warehouse without the wire: directly when this
        process serves it (``dock.local``), else through shared memory (``dock.same_node``);
        False sends those requests over the wire too (the baseline of ``tools/bench_dispatch``)."""
        self.cfg = cfg
        self.in_process = in_process
        self.meta = meta
        self.specs = specs
        self.peer = peer
        self.token = token
        self.centralized = cfg.mode == "centralized"
        self.server: WarehouseServer | None = None
        self._clients: dict[int, WarehouseClient | InProcessWarehouse] = {}
        self.relay_calls: dict[int, dict[str, int]] = {}
        """Per iteration and stage, the last relayed fetch's number (``dock.relay``)."""
        self.heartbeat: NodeLease | RankBeat | None = None
        """This rank's part of the liveness keys, when the dock runs with them
        (``dock.node_lease``): fetches then fail at once on a lost warehouse or rank instead of
        waiting ``dock.get_timeout_s``."""
        self.peer_watch: PeerWatch | None = None
        """This rank's watch of every liveness key, once armed (``TransferDock.watch_peers``)."""

    @property
    def home_node(self) -> int:
        """The node whose warehouse takes this rank's puts."""
        return 0 if self.centralized else self.peer.node

    def serves_warehouse(self) -> bool:
        return self.peer.rank == 0 if self.centralized else self.peer.local_rank == 0

    def client(self, node: int) -> WarehouseClient | InProcessWarehouse:
        if node not in self._clients and self.in_process and self.server is not None and node == self.home_node:
            self._clients[node] = InProcessWarehouse(
                self.server, f"warehouse of node {node}", self.cfg.max_message_bytes, self.server.pool
            )
        if node not in self._clients:
            address = self.warehouse_address(node)
            alive = None
            if self.heartbeat is not None:  # liveness-bounded fetches: a lost warehouse fails at once
                alive = lambda: self.warehouse_alive(node)  # noqa: E731
            kwargs = dict(
                timeout_s=self.cfg.get_timeout_s,
                max_message_bytes=self.cfg.max_message_bytes,
                alive=alive,
                name=f"warehouse of node {node}",
            )
            self._clients[node] = (
                SameNodeWarehouse(address, self.token, self.cfg.buffer_pool_bytes, **kwargs)
                if node == self.peer.node and self.in_process
                else WarehouseClient(address, self.token, **kwargs)
            )
        return self._clients[node]

    def warehouse_address(self, node: int) -> str:
        """The address node ``node``'s warehouse published, waited for ``dock.get_timeout_s``."""
        key = self.meta.key("warehouses", node)
        if (raw := self.meta.wait_for(key, self.cfg.get_timeout_s)) is None:
            raise DockTimeout(
                f"no warehouse registered at {key} after {self.cfg.get_timeout_s:.0f}s: is that node's local rank "
                f"0 running?"
            )
        return json.loads(raw)["address"]

    def warehouse_alive(self, node: int) -> bool:
        """Whether node ``node``'s warehouse still holds its liveness key: the peer watch's view
        when it is armed (no etcd read), else read from etcd."""
        if self.peer_watch is not None:
            return node not in self.peer_watch.lost_warehouses()
        return self.meta.get(self.meta.key("warehouse_alive", node)) is not None

    def lost_ranks(self) -> set[int]:
        """Ranks of the world whose liveness key is gone: the peer watch's view when it is
        armed (no etcd read), else read from etcd."""
        if self.peer_watch is not None:
            return self.peer_watch.lost_ranks()
        return set(range(self.peer.world)) - alive_ranks(self.meta)

    def plain_batch(self, iteration: int, indices: list[int], columns: list[str], loc: Locations) -> DockBatch:
        """``columns`` of ``indices`` fetched by this rank itself, as a batch."""
        return self.as_batch(indices, self.fetch(iteration, indices, columns, loc))

    def as_batch(self, indices: list[int], fetched: dict[str, list[torch.Tensor]]) -> DockBatch:
        """Fetched columns of ``indices`` as a ``DockBatch`` (which of them are ragged: their specs)."""
        return DockBatch(
            torch.tensor(indices, dtype=torch.int64), fetched, frozenset(c for c in fetched if self.specs[c].ragged)
        )

    def fetch(
        self, iteration: int, indices: list[int], columns: list[str], loc: Locations
    ) -> dict[str, list[torch.Tensor]]:
        """One request per (node, columns placed alike): columns whose indices live on the same
        nodes travel together; a column held by one node comes back in ``indices`` order as is."""
        out: dict[str, list[torch.Tensor]] = {}
        placed: dict[tuple[int, ...], list[str]] = {}
        for c in columns:
            placed.setdefault(tuple(map(loc.node[c].__getitem__, indices)), []).append(c)
        for nodes, cols in placed.items():
            per_node: dict[int, list[int]] = {}
            for k, node in enumerate(nodes):
                per_node.setdefault(node, []).append(k)
            if len(per_node) == 1:
                out |= self.client(nodes[0]).get(iteration, indices, cols)
                continue
            parts: dict[str, list[torch.Tensor | None]] = {c: [None] * len(indices) for c in cols}
            for node, ks in sorted(per_node.items()):
                got = self.client(node).get(iteration, [indices[k] for k in ks], cols)
                for c in cols:
                    for k, v in zip(ks, got[c]):
                        parts[c][k] = v
            out |= parts  # type: ignore[arg-type]
        return {c: out[c] for c in columns}
