"""A client of one warehouse (``dock.warehouse``): one DEALER connection, requests sealed with
the job's key, replies authenticated before they are decoded; a request bigger than the
warehouse accepts is refused here, before it is sent."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import zmq

from spmd_rl.dock.auth import job_key, seal, verify
from spmd_rl.dock.errors import DockRequestError, DockUnavailable
from spmd_rl.dock.store import flatten, unflatten
from spmd_rl.dock.wire import decode, encode


def check_frame_limit(op: Any, nbytes: int, limit: int) -> None:
    """Refuse, before sending, a frame the warehouse would drop (libzmq's ``MAXMSGSIZE``); the
    in-process path applies it too, so a put is refused alike whichever rank makes it."""
    if nbytes > limit:
        raise DockRequestError(
            f"a {op} frame of {nbytes} bytes exceeds dock.max_message_bytes={limit} "
            "(the warehouse would drop the connection): raise it or put fewer samples at once"
        )


class WarehouseClient:
    """One DEALER connection to one warehouse; one outstanding request at a time."""

    def __init__(
        self,
        address: str,
        token: str,
        timeout_s: float = 60.0,
        max_message_bytes: int = 1 << 30,
        alive: Callable[[], bool] | None = None,
        name: str = "warehouse",
    ):
        """``alive``: checked about every second while waiting for a reply; once it is False the
        request fails at once instead of waiting ``timeout_s`` for a dead warehouse."""
        self.alive = alive
        self.name = name
        self.address = address
        self.key = job_key(token)
        self.max_message_bytes = max_message_bytes
        self.timeout_ms = int(timeout_s * 1000)
        self._sock = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(address)
        self.bytes_sent = 0
        self.bytes_received = 0

    def close(self) -> None:
        self._sock.close()

    def request(
        self, header: dict[str, Any], tensors: list[torch.Tensor] | None = None
    ) -> list[tuple[dict, list[torch.Tensor]]]:
        """Send one request and collect every reply chunk; raise on an error reply."""
        frames = seal(self.key, b"req", encode(header, tensors or []))
        big = max(len(f) if isinstance(f, bytes) else f.nbytes for f in frames)
        check_frame_limit(header.get("op"), big, self.max_message_bytes)
        self.bytes_sent += sum(len(f) if isinstance(f, bytes) else f.nbytes for f in frames)
        self._sock.send_multipart(frames, copy=False)
        replies = []
        deadline = time.monotonic() + self.timeout_ms / 1000
        while True:
            if not self._sock.poll(min(1000, self.timeout_ms)):
                if self.alive is not None and not self.alive():
                    raise DockUnavailable(
                        f"{self.name} at {self.address} is lost (its liveness key in etcd is gone) during "
                        f"{header.get('op')}; exiting so torchrun can restart the group"
                    )
                if time.monotonic() < deadline:
                    continue
                raise DockUnavailable(
                    f"{self.name} at {self.address} did not answer {header.get('op')} within "
                    f"{self.timeout_ms / 1000:.0f}s"
                )
            raw = [f.buffer for f in self._sock.recv_multipart(copy=False)]
            self.bytes_received += sum(f.nbytes for f in raw)
            if not verify(self.key, b"rep", raw):
                raise DockRequestError(
                    f"{self.name} at {self.address}: the reply does not authenticate with this job's key: "
                    "wrong job token (check dock.token / $SPMD_RL_JOB_TOKEN) or not this job's warehouse"
                )
            head, out = decode(raw[1:])
            if "error" in head:
                raise DockRequestError(f"warehouse {self.address}: {head['error']}", head.get("kind"))
            replies.append((head, out))
            if head.get("last"):
                return replies

    def put(
        self, iteration: int, indices: list[int], columns: dict[str, list[torch.Tensor]], ragged: dict[str, bool]
    ) -> None:
        meta, flats = {}, []
        for name, values in columns.items():
            flat, lengths = flatten(values, ragged[name])
            meta[name] = {"ragged": ragged[name], "lengths": lengths}
            flats.append(flat)
        self.request({"op": "put", "iter": iteration, "indices": list(indices), "columns": meta}, flats)

    def get(self, iteration: int, indices: list[int], names: list[str]) -> dict[str, list[torch.Tensor]]:
        """Per-column list of per-sample tensors, in the order of ``indices``."""
        return self.samples(
            self.request({"op": "get", "iter": iteration, "indices": list(indices), "columns": names}), names
        )

    @staticmethod
    def samples(replies: list[tuple[dict, list[torch.Tensor]]], names: list[str]) -> dict[str, list[torch.Tensor]]:
        """The per-column samples of a get's reply chunks."""
        out: dict[str, list[torch.Tensor]] = {n: [] for n in names}
        for head, flats in replies:
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
