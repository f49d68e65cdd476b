"""The put-records of one iteration as a node's non-serving rank sees them: followed through its
node's warehouse (``dock.feed_host``), which follows etcd once for the whole node.

A thread of its own holds one long-poll ``records`` ask on a connection of its own: the
warehouse answers as soon as it has a record this rank has not seen, or after ``wait_s`` with
nothing. Construction returns once the warehouse's feed is open and its first records are
here, as ``RecordFeed``'s first read does. The feed ends when its iteration is dropped
(``closed``) or ``stop`` is called.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from spmd_rl.dock.errors import DockTimeout
from spmd_rl.dock.feed import RecordView
from spmd_rl.dock.records import PutRecord
from spmd_rl.dock.warehouse_client import WarehouseClient

log = logging.getLogger(__name__)


class NodeFeed(RecordView):
    """``RecordView`` fed by the node's warehouse."""

    def __init__(
        self,
        address: str,
        token: str,
        iteration: int,
        timeout_s: float = 60.0,
        wait_s: float = 1.0,
        name: str = "",
        alive: Callable[[], bool] | None = None,
    ):
        """``alive``: the warehouse's liveness (``WarehouseClient``), for a feed that follows
        another node's warehouse (``dock.records_group_nodes``)."""
        super().__init__()
        self.alive = alive
        self.address = address
        self.token = token
        self.iteration = iteration
        self.timeout_s = timeout_s
        self.wait_s = wait_s
        self.name = name or f"warehouse at {address}"
        self._feed_id: int | None = None
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        client = self._connect()
        deadline = time.monotonic() + timeout_s
        try:
            while self._feed_id is None and self._ask(client, 0.0):
                if time.monotonic() > deadline:
                    raise DockTimeout(
                        f"{self.name} opened no record feed for iteration {iteration} in {timeout_s:.0f}s"
                    )
                time.sleep(0.01)
        except BaseException:  # the client's socket goes with the feed that failed to open
            client.close()
            raise
        self._start(client)

    def _connect(self) -> WarehouseClient:
        return WarehouseClient(
            self.address, self.token, timeout_s=self.timeout_s + self.wait_s, alive=self.alive, name=self.name
        )

    def _ask(self, client: WarehouseClient, wait_s: float) -> bool:
        """One ask; False once the warehouse closed the feed (its iteration was dropped)."""
        ask = {"op": "records", "iter": self.iteration, "since": self.count, "feed": self._feed_id, "wait_s": wait_s}
        head = client.request(ask)[0][0]
        if head.get("closed"):
            self._closed.set()
            return False
        with self._cond:
            self._feed_id = head["feed"]
            for key, revision, raw in head["records"]:
                self._add(key, revision, PutRecord.decode(raw.encode()))
        return True

    def _start(self, client: WarehouseClient) -> None:
        self._thread = threading.Thread(target=self._follow, args=(client,), name="dock-node-feed", daemon=True)
        self._thread.start()

    def _follow(self, client: WarehouseClient) -> None:
        try:
            while not self._closed.is_set() and self._ask(client, self.wait_s):
                pass
        except Exception as exc:  # noqa: BLE001 - the next idle wait restarts it (``resync``)
            log.debug("record feed of iteration %d from %s ended: %s", self.iteration, self.name, exc)
        finally:
            client.close()

    @property
    def watching(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._closed.is_set()

    def resync(self) -> None:
        """Follow the warehouse again after the ask failed (it keeps its own feed current)."""
        if not self._closed.is_set() and not self.watching:
            self._start(self._connect())

    def stop(self) -> None:
        """End the feed; its thread returns with its current ask (at most ``wait_s``)."""
        self._closed.set()
