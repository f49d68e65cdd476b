"""The record feeds a node's warehouse keeps for every rank of its node: one ``RecordFeed`` per
iteration, read in process by the serving rank and through the warehouse's ``records`` op by
the node's other ranks (``dock.node_feed``).

With a feed per rank etcd streams each put-record to every rank: R records x R ranks events per
iteration, the first limit of the control plane (etcd CPU, ``docs/design.md``, "Scale limits").
With a feed per node it streams each record once per node, R x S, and a node's other ranks
never touch etcd for records at all. With groups of nodes (``dock.records_group_nodes`` = G)
only the group's first warehouse follows etcd and the group's other warehouses follow it
through its ``records`` op (``source``: a ``NodeFeed``), as a node's ranks do: R x S / G.

Invariants: the warehouse's serving thread never waits on etcd (a keeper thread opens the
feeds asked for over the wire and resyncs a broken one, e.g. after an etcd restart); a feed
closes when its iteration is dropped and is never reopened by a follower's late ask.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spmd_rl.dock.errors import DockRequestError
from spmd_rl.dock.feed import RecordFeed, RecordView
from spmd_rl.dock.metadata import MetadataStore
from spmd_rl.dock.wire import encode, is_int

log = logging.getLogger(__name__)

CLOSED = "closed"
"""``lookup``'s answer to a follower whose feed was closed (its iteration was dropped)."""


class FeedHost:
    """One node's record feeds by iteration, opened on first ask and closed by ``drop``. Each
    opened feed has an id; a follower names the id it follows, so an ask that arrives after
    the drop is told ``CLOSED`` instead of reopening a feed nobody would close."""

    def __init__(
        self, meta: MetadataStore, heal_every_s: float = 0.5, source: Callable[[int], RecordView] | None = None
    ):
        """``source(iteration)``: the feed to keep for an iteration (default: etcd's, a
        ``RecordFeed``; a group's other warehouses: a ``NodeFeed`` of the group's first)."""
        self.meta = meta
        self.heal_every_s = heal_every_s
        self.source = source or (lambda iteration: RecordFeed(meta, iteration))
        self._feeds: dict[int, tuple[int, RecordView]] = {}
        self._asked: set[int] = set()
        self._opened = 0
        self._lock = threading.Lock()
        self.signal, self._signal_w = os.pipe()
        """Readable once a feed has a new record (the serving thread polls it with its socket)."""
        os.set_blocking(self.signal, False)
        os.set_blocking(self._signal_w, False)
        self._signaled = threading.Event()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._keep, name="dock-feed-keeper", daemon=True)
        self._thread.start()

    def open(self, iteration: int) -> RecordView:
        """The iteration's feed, opened here if it is not (the serving rank's own reads)."""
        with self._lock:
            if iteration in self._feeds:
                return self._feeds[iteration][1]
        return self._install(iteration, self.source(iteration), asked_only=False)  # its I/O unlocked

    def _install(self, iteration: int, fresh: RecordView, asked_only: bool) -> RecordView:
        """Keep ``fresh`` unless a feed is open already (or, ``asked_only``, the ask was dropped)."""
        with self._lock:
            wanted = iteration in self._asked or not asked_only
            self._asked.discard(iteration)
            if iteration not in self._feeds and wanted:
                self._opened += 1
                self._feeds[iteration] = (self._opened, fresh)
                fresh.listen(self._changed)
                self._changed()  # its first read: an ask held while it opened is due
                return fresh
            kept = self._feeds.get(iteration, (0, None))[1]
        fresh.stop()
        return kept

    def lookup(self, iteration: int, feed_id: int | None) -> tuple[int, RecordView] | str | None:
        """For the serving thread, without etcd I/O: (id, feed); ``CLOSED`` when the follower's
        ``feed_id`` is no longer open; None while the keeper opens a feed first asked for."""
        with self._lock:
            held = self._feeds.get(iteration)
            if feed_id is not None:
                return held if held is not None and held[0] == feed_id else CLOSED
            if held is not None:
                return held
            self._asked.add(iteration)
        self._wake.set()
        return None

    def _changed(self) -> None:
        if not self._signaled.is_set():
            self._signaled.set()
            try:
                os.write(self._signal_w, b"!")
            except BlockingIOError:  # already full of wake-ups
                pass

    def drain(self) -> None:
        """Consume the wake-ups; the serving thread then answers the held asks, so a record
        that lands between the read and the clear is still seen."""
        try:
            os.read(self.signal, 4096)
        except BlockingIOError:
            pass
        self._signaled.clear()

    def drop(self, iteration: int) -> None:
        with self._lock:
            held = self._feeds.pop(iteration, None)
            self._asked.discard(iteration)
        if held is not None:
            held[1].stop()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)
        with self._lock:
            feeds = [f for _, f in self._feeds.values()]
            self._feeds.clear()
        for feed in feeds:
            feed.stop()
        os.close(self.signal)
        os.close(self._signal_w)

    def _keep(self) -> None:
        """Open what was asked for; resync what broke. etcd away: try again next round."""
        while not self._stop.is_set():
            self._wake.wait(self.heal_every_s)
            self._wake.clear()
            with self._lock:
                asked = sorted(self._asked)
                broken = [f for _, f in self._feeds.values() if not f.watching]
            for it in asked:
                try:
                    self._install(it, self.source(it), asked_only=True)
                except Exception as exc:  # noqa: BLE001 - etcd away: the next round tries again
                    log.warning("warehouse cannot open the record feed of iteration %d: %s", it, exc)
            for feed in broken:
                try:
                    feed.resync()
                except Exception as exc:  # noqa: BLE001 - etcd away: the next round tries again
                    log.warning("warehouse cannot resync a record feed: %s", exc)


@dataclass
class _Ask:
    ident: Any
    iteration: int
    feed_id: int | None
    since: int
    deadline: float


class RecordAsks:
    """The warehouse's ``records`` op: ``{iter, since, feed?, wait_s}`` -> ``{feed, records:
    [[key, create revision, record JSON]]}`` with every record after the first ``since`` of
    the feed ``feed`` (the iteration's open feed when absent; ``feed`` None in the reply while
    it opens), or ``{closed}``.
    An ask with nothing new is held, not answered, until a record arrives (the feed's wake-up
    pipe, ``FeedHost.signal``, wakes the serving thread) or ``wait_s`` passes: a long poll, so a
    follower idle in a wait costs one ask per ``wait_s`` and a record reaches it at once."""

    MAX_WAIT_S = 30.0

    def __init__(self, host: FeedHost):
        self.host = host
        self._held: list[_Ask] = []

    def take(self, ident: Any, head: dict[str, Any]) -> list[list]:
        """The reply now, or [] while the ask is held (``due`` answers it later)."""
        it, since, feed_id, wait_s = head.get("iter"), head.get("since"), head.get("feed"), head.get("wait_s", 0)
        if not (_nonneg_int(since) and (feed_id is None or _nonneg_int(feed_id))):
            raise DockRequestError("records needs an integer since >= 0 and an integer feed (or none)")
        if not isinstance(wait_s, (int, float)) or not 0 <= wait_s <= self.MAX_WAIT_S:
            raise DockRequestError(f"records needs 0 <= wait_s <= {self.MAX_WAIT_S}")
        ask = _Ask(ident, it, feed_id, since, time.monotonic() + wait_s)
        reply = self._reply(ask, final=wait_s == 0)
        if reply is None:
            self._held.append(ask)
            return []
        return reply

    def due(self) -> list[tuple[Any, list[list]]]:
        """(ident, reply) of every held ask that has something new or ran out of time."""
        now, out, kept = time.monotonic(), [], []
        for ask in self._held:
            reply = self._reply(ask, final=now >= ask.deadline)
            if reply is None:
                kept.append(ask)
            else:
                out.append((ask.ident, reply))
        self._held = kept
        return out

    def _reply(self, ask: _Ask, final: bool) -> list[list] | None:
        got = self.host.lookup(ask.iteration, ask.feed_id)
        if got == CLOSED:
            return [encode({"closed": True, "last": True}, [])]
        new = got is not None and got[1].count > ask.since
        if not new and not final:
            return None
        rows = [[key, rev, rec.encode().decode()] for key, rev, rec in got[1].since(ask.since)] if new else []
        return [encode({"feed": got and got[0], "records": rows, "last": True}, [])]


def _nonneg_int(x: Any) -> bool:
    return is_int(x) and x >= 0
