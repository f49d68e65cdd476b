"""A warehouse: one node's share of the samples, in host memory, served over pyzmq.

Storage: ``{iteration: {column: {index: tensor}}}``; a ragged column holds one unpadded 1-D
tensor per sample (views into the received buffer). A put is atomic: it is fully validated
before anything is stored, so a refused put leaves earlier data intact.

Protocol (ROUTER server, DEALER clients): every request is ``encode(header, tensors)`` with
``header["token"]`` equal to the job token, else it is refused and logged. Ops:

- ``put``    {iter, indices, columns: {name: {ragged, lengths?}}} + one flat tensor per column
- ``get``    {iter, indices, columns}  -> replies in chunks of at most ``bucket_bytes``, each
             {chunk, last, indices, columns: {name: {ragged, lengths?}}} + one flat tensor per column
- ``delete`` {iter, indices, columns}  (roll back a put whose metadata record failed)
- ``drop``   {iter}                    (free a committed iteration)
- ``stats``  {}                        -> {bytes_in, bytes_out, samples, by_iteration}
"""

from __future__ import annotations

import hmac
import logging
import threading
from collections import defaultdict
from typing import Any

import torch
import zmq

from spmd_rl.dock.errors import DockRequestError, DockUnavailable
from spmd_rl.dock.wire import WireError, decode, encode

log = logging.getLogger(__name__)


def flatten(values: list[torch.Tensor], ragged: bool) -> tuple[torch.Tensor, list[int] | None]:
    """Samples -> (one flat tensor, per-sample lengths for ragged columns)."""
    if ragged:
        return (torch.cat([v.reshape(-1) for v in values]) if values else torch.empty(0)), [v.numel() for v in values]
    return torch.stack(values) if values else torch.empty(0), None


def unflatten(flat: torch.Tensor, n: int, lengths: list[int] | None) -> list[torch.Tensor]:
    if lengths is not None:
        if len(lengths) != n or sum(lengths) != flat.numel():
            raise DockRequestError(f"ragged lengths {len(lengths)} / {sum(lengths)} do not match {n} samples / {flat.numel()} values")
        return list(torch.split(flat, lengths))
    if flat.shape[:1] != (n,):
        raise DockRequestError(f"fixed column has leading size {tuple(flat.shape[:1])}, expected {n}")
    return list(flat.unbind(0))


class WarehouseStore:
    """The in-memory columns of one node; not thread-safe (owned by the server thread)."""

    def __init__(self) -> None:
        self.data: dict[int, dict[str, dict[int, torch.Tensor]]] = {}
        self.ragged: dict[int, dict[str, bool]] = {}
        self.bytes_in = 0
        self.bytes_out = 0
        self.bytes_out_by_iter: dict[int, int] = defaultdict(int)

    def put(self, iteration: int, indices: list[int], columns: dict[str, list[torch.Tensor]], ragged: dict[str, bool]) -> None:
        cols = self.data.get(iteration, {})
        kinds = self.ragged.get(iteration, {})
        for name in columns:
            if kinds.get(name, ragged[name]) != ragged[name]:
                raise DockRequestError(f"column {name!r} was stored as {'ragged' if kinds[name] else 'fixed'}; this put sends it otherwise")
            dup = [i for i in indices if i in cols.get(name, {})]
            if dup:
                raise DockRequestError(f"column {name!r} already stored for indices {dup[:8]}{'...' if len(dup) > 8 else ''} of iteration {iteration}: duplicate put")
        if len(set(indices)) != len(indices):
            raise DockRequestError("indices of one put must be distinct")
        cols = self.data.setdefault(iteration, {})
        self.ragged.setdefault(iteration, {}).update(ragged)
        for name, values in columns.items():
            store = cols.setdefault(name, {})
            for i, v in zip(indices, values):
                store[i] = v
                self.bytes_in += v.numel() * v.element_size()

    def get(self, iteration: int, indices: list[int], names: list[str]) -> dict[str, list[torch.Tensor]]:
        cols = self.data.get(iteration, {})
        out = {}
        for name in names:
            store = cols.get(name, {})
            missing = [i for i in indices if i not in store]
            if missing:
                raise DockRequestError(f"column {name!r} not stored here for indices {missing[:8]} of iteration {iteration}")
            out[name] = [store[i] for i in indices]
        return out

    def delete(self, iteration: int, indices: list[int], names: list[str]) -> None:
        cols = self.data.get(iteration, {})
        for name in names:
            for i in indices:
                cols.get(name, {}).pop(i, None)

    def drop(self, iteration: int) -> None:
        self.data.pop(iteration, None)
        self.ragged.pop(iteration, None)

    def samples(self) -> int:
        return sum(len(col) for cols in self.data.values() for col in cols.values())


class WarehouseServer:
    """Background thread serving a :class:`WarehouseStore` on ``tcp://interface:port``."""

    def __init__(self, interface: str, port: int, token: str, bucket_bytes: int = 64 << 20):
        self.token = token
        self.bucket_bytes = bucket_bytes
        self.store = WarehouseStore()
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            if port == 0:
                self.port = self._sock.bind_to_random_port(f"tcp://{interface}")
            else:
                self._sock.bind(f"tcp://{interface}:{port}")
                self.port = port
        except zmq.ZMQError as exc:
            self._sock.close()
            raise DockUnavailable(f"warehouse cannot bind {interface}:{port} ({exc}); set dock.interface/dock.port") from exc
        self.address = f"tcp://{interface}:{self.port}"
        self.refused = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="warehouse", daemon=True)

    def start(self) -> "WarehouseServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self._sock.close()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            ident, *frames = self._sock.recv_multipart(copy=False)
            for reply in self._handle(frames):
                self._sock.send_multipart([ident, *reply], copy=False)

    def _handle(self, frames: list) -> list[list]:
        try:
            head, tensors = decode([f.buffer for f in frames])
        except WireError as exc:
            return [encode({"error": f"bad request: {exc}", "last": True}, [])]
        if not hmac.compare_digest(str(head.get("token", "")).encode(), self.token.encode()):
            self.refused += 1
            log.warning("warehouse %s refused a request with a wrong job token (op=%s)", self.address, head.get("op"))
            return [encode({"error": "refused: wrong job token (check dock.token / $SPMD_RL_JOB_TOKEN)", "last": True}, [])]
        try:
            return self._dispatch(head, tensors)
        except (DockRequestError, WireError, KeyError, TypeError, ValueError) as exc:
            return [encode({"error": f"{type(exc).__name__}: {exc}", "last": True}, [])]
        except Exception as exc:  # the server thread must outlive any one request
            log.exception("warehouse %s failed on op=%s", self.address, head.get("op"))
            return [encode({"error": f"internal error: {type(exc).__name__}: {exc}", "last": True}, [])]

    def _dispatch(self, head: dict[str, Any], tensors: list[torch.Tensor]) -> list[list]:
        op, it = head.get("op"), int(head.get("iter", -1))
        if op == "put":
            indices = [int(i) for i in head["indices"]]
            cols = {
                name: unflatten(t, len(indices), spec.get("lengths") if spec.get("ragged") else None)
                for (name, spec), t in zip(head["columns"].items(), tensors)
            }
            self.store.put(it, indices, cols, {name: bool(spec.get("ragged")) for name, spec in head["columns"].items()})
            return [encode({"ok": True, "last": True}, [])]
        if op == "get":
            return self._reply_get(it, [int(i) for i in head["indices"]], list(head["columns"]))
        if op == "delete":
            self.store.delete(it, [int(i) for i in head["indices"]], list(head["columns"]))
            return [encode({"ok": True, "last": True}, [])]
        if op == "drop":
            self.store.drop(it)
            return [encode({"ok": True, "last": True}, [])]
        if op == "stats":
            s = self.store
            return [encode({"bytes_in": s.bytes_in, "bytes_out": s.bytes_out, "samples": s.samples(),
                            "bytes_out_by_iter": {str(k): v for k, v in s.bytes_out_by_iter.items()}, "refused": self.refused, "last": True}, [])]
        raise DockRequestError(f"unknown op {op!r}")

    def _reply_get(self, it: int, indices: list[int], names: list[str]) -> list[list]:
        cols = self.store.get(it, indices, names)
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
                vals = cols[n][a:b]
                ragged = self.store.ragged[it][n]
                flat, lengths = flatten(vals, ragged)
                meta[n] = {"ragged": ragged, "lengths": lengths}
                flats.append(flat)
            nbytes = sum(f.numel() * f.element_size() for f in flats)
            self.store.bytes_out += nbytes
            self.store.bytes_out_by_iter[it] += nbytes
            replies.append(encode({"chunk": c, "last": c == len(chunks) - 1, "indices": indices[a:b], "columns": meta}, flats))
        return replies



class WarehouseClient:
    """One DEALER connection to one warehouse; one outstanding request at a time."""

    def __init__(self, address: str, token: str, timeout_s: float = 60.0):
        self.address = address
        self.token = token
        self.timeout_ms = int(timeout_s * 1000)
        self._sock = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(address)
        self.bytes_sent = 0
        self.bytes_received = 0

    def close(self) -> None:
        self._sock.close()

    def request(self, header: dict[str, Any], tensors: list[torch.Tensor] | None = None) -> list[tuple[dict, list[torch.Tensor]]]:
        """Send one request and collect every reply chunk; raise on an error reply."""
        frames = encode(dict(header, token=self.token), tensors or [])
        self.bytes_sent += sum(len(f) if isinstance(f, bytes) else f.nbytes for f in frames)
        self._sock.send_multipart(frames, copy=False)
        replies = []
        while True:
            if not self._sock.poll(self.timeout_ms):
                raise DockUnavailable(f"warehouse {self.address} did not answer {header.get('op')} within {self.timeout_ms / 1000:.0f}s")
            raw = self._sock.recv_multipart(copy=False)
            self.bytes_received += sum(f.buffer.nbytes for f in raw)
            head, out = decode([f.buffer for f in raw])
            if "error" in head:
                raise DockRequestError(f"warehouse {self.address}: {head['error']}")
            replies.append((head, out))
            if head.get("last"):
                return replies

    def put(self, iteration: int, indices: list[int], columns: dict[str, list[torch.Tensor]], ragged: dict[str, bool]) -> None:
        meta, flats = {}, []
        for name, values in columns.items():
            flat, lengths = flatten(values, ragged[name])
            meta[name] = {"ragged": ragged[name], "lengths": lengths}
            flats.append(flat)
        self.request({"op": "put", "iter": iteration, "indices": list(indices), "columns": meta}, flats)

    def get(self, iteration: int, indices: list[int], names: list[str]) -> dict[str, list[torch.Tensor]]:
        """Per-column list of per-sample tensors, in the order of ``indices``."""
        out: dict[str, list[torch.Tensor]] = {n: [] for n in names}
        for head, flats in self.request({"op": "get", "iter": iteration, "indices": list(indices), "columns": names}):
            n = len(head["indices"])
            for (name, spec), flat in zip(head["columns"].items(), flats):
                out[name] += unflatten(flat, n, spec["lengths"] if spec["ragged"] else None)
        return out

    def delete(self, iteration: int, indices: list[int], names: list[str]) -> None:
        self.request({"op": "delete", "iter": iteration, "indices": list(indices), "columns": names})

    def drop(self, iteration: int) -> None:
        self.request({"op": "drop", "iter": iteration})

    def stats(self) -> dict[str, Any]:
        return self.request({"op": "stats"})[0][0]
