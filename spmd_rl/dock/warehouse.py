"""A warehouse: one node's share of the samples (``store.WarehouseStore``), served over pyzmq.

Protocol (ROUTER server, DEALER clients): every request and reply is ``encode(header,
tensors)`` sealed with the job's HMAC (``dock.auth``; the token itself never travels).
Hardening (invariant: no input from any peer stops the server or alters stored data):

- the MAC is checked over the frames as received, before any header is parsed or any buffer
  copied;
- libzmq drops a peer whose frame exceeds ``dock.max_message_bytes`` (``zmq.MAXMSGSIZE``);
- every field of a request is type-checked; shapes are checked with Python ints against an
  element limit (``wire.check_meta``), so no declared size can overflow or over-allocate;
- refusals are counted (``refused``: unauthenticated or malformed; ``rejected``: authenticated
  but invalid) and logged at most once per peer and kind every ``LOG_EVERY_S``.

Ops:

- ``put``    {iter, indices, columns: {name: {ragged, lengths?}}} + one flat tensor per column
- ``get``    {iter, indices, columns}  -> replies in chunks of at most ``bucket_bytes``, each
             {chunk, last, indices, columns: {name: {ragged, lengths?}}} + one flat tensor per column
- ``put`` / ``get`` with ``shm``: a same-node rank's payload through its own memory (``dock.shm``)
- ``delete`` {iter, indices, columns}  (roll back a put whose metadata record failed)
- ``drop``   {iter}                    (free a committed iteration and close its record feed)
- ``records`` {iter, since, feed?, wait_s} -> the node's put-records of the iteration after the
             first ``since``, held up to ``wait_s`` until there are some (``dock.feed_host``)
- ``stats``  {}                        -> {bytes_in, bytes_out, samples, by_iteration, refused, rejected}
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from typing import Any

import torch
import zmq

from spmd_rl.dock.auth import job_key, seal, verify
from spmd_rl.dock.errors import DockRequestError, DockUnavailable
from spmd_rl.dock.feed_host import FeedHost, RecordAsks
from spmd_rl.dock.host_pool import HostPool
from spmd_rl.dock.shm import put_columns, serve_get
from spmd_rl.dock.store import WarehouseStore, flatten, unflatten
from spmd_rl.dock.wire import WireError, decode, encode, is_int

log = logging.getLogger(__name__)
LOG_EVERY_S = 10.0


def _valid_spec(name: Any, spec: Any) -> bool:
    if not isinstance(name, str) or not isinstance(spec, dict) or not isinstance(spec.get("ragged", False), bool):
        return False
    lengths = spec.get("lengths")
    return lengths is None or isinstance(lengths, list) and all(is_int(n) and n >= 0 for n in lengths)


def _peer_of(frame) -> str:
    """The TCP peer address of a received frame (libzmq metadata), else its routing id."""
    try:
        return str(frame.get("Peer-Address"))
    except (zmq.ZMQError, AttributeError, TypeError):
        return f"id:{bytes(frame.buffer[:8]).hex()}"


class WarehouseServer:
    """Background thread serving a :class:`WarehouseStore` on ``tcp://interface:port``."""

    def __init__(
        self,
        interface: str,
        port: int,
        token: str,
        bucket_bytes: int = 64 << 20,
        max_message_bytes: int = 1 << 30,
        pool_bytes: int = 512 << 20,
    ):
        """``pool_bytes``: idle bytes of freed buffers ``pool`` keeps for the next puts that
        arrive through shared memory and for the serving rank's in-process copies."""
        self.key = job_key(token)
        self.pool = HostPool(pool_bytes)
        self.bucket_bytes = bucket_bytes
        self.max_message_bytes = max_message_bytes
        self.store = WarehouseStore()
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)  # libzmq drops a peer that sends a bigger frame
        try:
            if port == 0:
                self.port = self._sock.bind_to_random_port(f"tcp://{interface}")
            else:
                self._sock.bind(f"tcp://{interface}:{port}")
                self.port = port
        except zmq.ZMQError as exc:
            self._sock.close()
            raise DockUnavailable(
                f"warehouse cannot bind {interface}:{port} ({exc}); set dock.interface/dock.port"
            ) from exc
        self.address = f"tcp://{interface}:{self.port}"
        self.refused = 0
        """Requests refused before authentication (missing or wrong MAC: not this job's token)."""
        self.rejected = 0
        """Authenticated requests that failed validation."""
        self.refusals: dict[str, dict[str, int]] = {}
        self._last_log: dict[tuple[str, str], float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="warehouse", daemon=True)
        self.feeds: FeedHost | None = None
        self._asks: RecordAsks | None = None

    def keep_feeds(self, host: FeedHost) -> None:
        """Serve the node's record feeds (the ``records`` op) from ``host``; before ``start``."""
        self.feeds = host
        self._asks = RecordAsks(host)

    def start(self) -> "WarehouseServer":
        self._thread.start()
        return self

    def serving(self) -> bool:
        """True while the serve thread runs (the warehouse heartbeat withdraws its key otherwise)."""
        return self._thread.is_alive() and not self._stop.is_set()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self._sock.close()
        if self.feeds is not None:
            self.feeds.close()

    def drop(self, iteration: int) -> None:
        """Free a committed iteration: its samples and its record feed."""
        self.store.drop(iteration)
        if self.feeds is not None:
            self.feeds.drop(iteration)

    def _serve(self) -> None:
        """Serve until stopped. Invariant: nothing a peer sends ends this loop; a request that
        fails in an unforeseen way is answered with an error and logged (rate-limited)."""
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        if self.feeds is not None:  # a new record wakes the loop: held record asks are answered at once
            poller.register(self.feeds.signal, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                ready = dict(poller.poll(100))
                if self._sock in ready:
                    ident, *frames = self._sock.recv_multipart(copy=False)
                    for reply in self._handle(frames, _peer_of(ident), ident):
                        self._send(ident, reply)
                if self.feeds is not None and self.feeds.signal in ready:
                    self.feeds.drain()
                for ident, replies in self._asks.due() if self._asks is not None else ():
                    for reply in replies:
                        self._send(ident, reply)
            except Exception as exc:  # noqa: BLE001 - the thread must outlive any request
                self._note("serve", "loop", f"{type(exc).__name__}: {exc}")

    def _send(self, ident, reply: list) -> None:
        self._sock.send_multipart([ident, *seal(self.key, b"rep", reply)], copy=False)

    def _note(self, kind: str, peer: str, reason: str) -> None:
        """Count a refusal; log it at most once per peer and kind every ``LOG_EVERY_S``."""
        counts = self.refusals.setdefault(peer, defaultdict(int))
        counts[kind] += 1
        now = time.monotonic()
        if now - self._last_log.get((peer, kind), -LOG_EVERY_S) >= LOG_EVERY_S:
            self._last_log[(peer, kind)] = now
            log.warning(
                "warehouse %s %s a request from %s (%d so far): %s",
                self.address,
                kind,
                peer,
                counts[kind],
                reason[:200],
            )

    def _handle(self, frames: list, peer: str, ident=None) -> list[list]:
        """Authenticate the frames as received (nothing is parsed or copied before the MAC
        matches), then decode and dispatch. Returns unsealed replies ([] for an ask held)."""
        buffers = [f.buffer for f in frames]
        if not verify(self.key, b"req", buffers):
            self.refused += 1
            self._note("refused", peer, f"missing or wrong MAC ({len(buffers)} frames): not this job's token")
            return [
                encode({"error": "refused: the request does not authenticate (wrong job token?)", "last": True}, [])
            ]
        try:
            head, tensors = decode(buffers[1:])
            return self._dispatch(head, tensors, ident)
        except (DockRequestError, WireError) as exc:
            self.rejected += 1
            self._note("rejected", peer, str(exc))
            return [encode({"error": f"{type(exc).__name__}: {exc}", "kind": type(exc).__name__, "last": True}, [])]
        except Exception as exc:  # noqa: BLE001 - the server thread must outlive any one request
            self.rejected += 1
            self._note("failed", peer, f"{type(exc).__name__}: {exc}")
            return [encode({"error": f"internal error: {type(exc).__name__}: {exc}", "last": True}, [])]

    def _dispatch(self, head: dict[str, Any], tensors: list[torch.Tensor], ident=None) -> list[list]:
        op = head.get("op")
        if op == "stats":
            return self._stats()
        it = head.get("iter")
        if not is_int(it):
            raise DockRequestError(f"op {op!r} needs an integer iter")
        if op == "drop":
            self.drop(it)
            return [encode({"ok": True, "last": True}, [])]
        if op == "records":
            if self._asks is None:
                raise DockRequestError("this warehouse keeps no record feeds (centralized dock)")
            return self._asks.take(ident, head)
        indices = head.get("indices")
        if not isinstance(indices, list) or not all(is_int(i) for i in indices):
            raise DockRequestError("indices must be a list of integers")
        if op == "put" and "shm" in head and not tensors:
            cols, ragged = put_columns(
                self.key, indices, head.get("columns"), head["shm"], self.max_message_bytes, self.pool
            )
            self.store.put(it, indices, cols, ragged)
            return [encode({"ok": True, "last": True}, [])]
        if op == "put":
            specs = head.get("columns")
            if (
                not isinstance(specs, dict)
                or len(specs) != len(tensors)
                or not all(_valid_spec(n, v) for n, v in specs.items())
            ):
                raise DockRequestError(
                    "put columns must map names to {ragged: bool, lengths: [int] | null}, one per tensor"
                )
            cols = {
                name: unflatten(t, len(indices), spec.get("lengths") if spec.get("ragged") else None)
                for (name, spec), t in zip(specs.items(), tensors)
            }
            self.store.put(it, indices, cols, {name: bool(spec.get("ragged")) for name, spec in specs.items()})
            return [encode({"ok": True, "last": True}, [])]
        names = head.get("columns")
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise DockRequestError("columns must be a list of names")
        if op == "get":
            answer = serve_get(self.store, self.key, it, indices, names, head["shm"]) if "shm" in head else None
            return [encode(answer | {"last": True}, [])] if answer else self._reply_get(it, indices, names)
        if op == "delete":
            self.store.delete(it, indices, names)
            return [encode({"ok": True, "last": True}, [])]
        raise DockRequestError(f"unknown op {str(op)[:40]!r}")

    def _stats(self) -> list[list]:
        return [encode({**self.store.stats(), "refused": self.refused, "rejected": self.rejected, "last": True}, [])]

    def _reply_get(self, it: int, indices: list[int], names: list[str]) -> list[list]:
        cols, ragged = self.store.get(it, indices, names)
        per_sample = [sum(cols[n][k].numel() * cols[n][k].element_size() for n in names) for k in range(len(indices))]
        chunks, start, acc = [], 0, 0
        for k, b in enumerate(per_sample):
            if k > start and acc + b > self.bucket_bytes:
                chunks.append((start, k))
                start, acc = k, 0
            acc += b
        chunks.append((start, len(indices)))
        replies = []
        for c, (a, b) in enumerate(chunks):
            meta, flats = {}, []
            for n in names:
                flat, lengths = flatten(cols[n][a:b], ragged[n])
                meta[n] = {"ragged": ragged[n], "lengths": lengths}
                flats.append(flat)
            self.store.count_out(it, sum(f.numel() * f.element_size() for f in flats))
            replies.append(
                encode({"chunk": c, "last": c == len(chunks) - 1, "indices": indices[a:b], "columns": meta}, flats)
            )
        return replies
