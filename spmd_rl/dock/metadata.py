"""Metadata store on the etcd v3 API, behind a small interface.

Client: ``etcd3gw`` (etcd's v3 JSON gateway over HTTP). Chosen because ``etcd3`` 0.12 does not
import with the protobuf this environment needs unless the slow pure-python protobuf is
forced, and ``aetcd`` is asyncio-only while every caller here is synchronous. The interface is
small so another client can replace it.

TLS (``EtcdTLS``): the session verifies etcd against the job's CA and presents the client
certificate; it ignores $REQUESTS_CA_BUNDLE and proxy variables, which requests would
otherwise let override the CA. Plain HTTP ignores proxy variables too: etcd is reached
directly, never through a proxy a user set for the outside world. A refused handshake fails at once with the fix, not
after ``retry_s``.

Keys live under ``/<job>/``; per-iteration data under ``/<job>/<iteration>/``. Values are bytes
(JSON from callers), never pickles. Every call retries a lost etcd with exponential backoff for
``retry_s`` seconds and then raises :class:`DockUnavailable`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import requests
from etcd3gw.client import Etcd3Client
from etcd3gw.lease import Lease
from etcd3gw.exceptions import ConnectionFailedError, Etcd3Exception
from etcd3gw.utils import _decode, _encode, _increment_last_byte

from spmd_rl.dock.errors import DockError, DockUnavailable
from spmd_rl.dock.watch_stream import WatchStream

T = TypeVar("T")
_TRANSIENT = (ConnectionFailedError, requests.ConnectionError, requests.Timeout, Etcd3Exception)


@dataclass(frozen=True)
class EtcdTLS:
    ca_file: str
    cert_file: str | None = None
    key_file: str | None = None

    @classmethod
    def of(cls, metadata_cfg) -> "EtcdTLS | None":
        """From ``metadata.ca_file/cert_file/key_file`` (None without a CA: plain HTTP)."""
        if not metadata_cfg.ca_file:
            return None
        return cls(metadata_cfg.ca_file, metadata_cfg.cert_file, metadata_cfg.key_file)

    def session(self) -> requests.Session:
        s = requests.Session()
        s.trust_env = False
        s.verify = self.ca_file
        if self.cert_file:
            s.cert = (self.cert_file, self.key_file)
        return s


class LeaseGone(DockError):
    """A put named a lease etcd no longer has (it expired, or was never granted there)."""


@dataclass(frozen=True)
class LeaseId:
    """A lease another process holds, named by its id: ``put(..., lease=LeaseId(id))`` puts a
    key that expires with that lease (``dock.node_lease``)."""

    id: int


@dataclass(frozen=True)
class StoreLease:
    """A lease this process holds, renewed and revoked through its store's ``_call``: the same
    retry and endpoint failover as every other call, not the one client (and endpoint) that
    granted it. A lease is etcd's, not an endpoint's: any member of the cluster renews it, so
    losing the endpoint it was granted through costs one failover, not the lease."""

    id: int
    store: "MetadataStore"

    def refresh(self) -> int:
        """The lease's new TTL; <= 0 once it expired (its keys are gone)."""
        return self.store._call(lambda c: Lease(self.id, c).refresh())

    def revoke(self) -> None:
        self.store._call(lambda c: Lease(self.id, c).revoke())


def _tls_failure(exc: BaseException) -> BaseException | None:
    while exc is not None:
        if isinstance(exc, requests.exceptions.SSLError):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


class MetadataStore:
    """put/get/prefix/delete/create(put-if-absent)/replace(CAS)/lease/watch over one job prefix."""

    def __init__(
        self, endpoints: list[str], job: str, retry_s: float = 30.0, timeout_s: float = 5.0, tls: EtcdTLS | None = None
    ):
        if not endpoints:
            raise ValueError("metadata.endpoints is empty: start an embedded etcd first")
        self.endpoints = list(endpoints)
        self.job = job.strip("/")
        self.retry_s = retry_s
        self._timeout = timeout_s
        self._local = threading.local()
        self._current = 0
        self.tls = tls

    # -- connection ---------------------------------------------------------------------------
    def _client(self) -> Etcd3Client:
        client = getattr(self._local, "client", None)
        if client is None:
            host, _, port = self.endpoints[self._current % len(self.endpoints)].rpartition(":")
            host = host.removeprefix("https://").removeprefix("http://")
            if self.tls is None:
                session = requests.Session()
                session.trust_env = (
                    False  # no proxy variables (nor their lookup on every request) between a rank and etcd
                )
                client = Etcd3Client(host=host, port=int(port), timeout=self._timeout, session=session)
            else:
                client = Etcd3Client(
                    host=host, port=int(port), protocol="https", timeout=self._timeout, session=self.tls.session()
                )
            self._local.client = client
        return client

    def _call(self, op: Callable[[Etcd3Client], T]) -> T:
        deadline = time.monotonic() + self.retry_s
        delay = 0.05
        while True:
            try:
                return op(self._client())
            except _TRANSIENT as exc:
                if "lease not found" in str(getattr(exc, "detail_text", "") or ""):
                    raise LeaseGone(f"etcd has no such lease: {exc.detail_text}") from exc
                if (tls := _tls_failure(exc)) is not None:
                    raise DockUnavailable(
                        f"etcd {self.endpoints} refused the TLS connection ({tls}): set metadata.ca_file, "
                        "cert_file and key_file to the job's CA and client certificate (launch/make_certs.sh)"
                    ) from exc
                if time.monotonic() + delay > deadline:
                    hint = "" if self.tls else "; if it serves TLS only, set metadata.ca_file/cert_file/key_file"
                    raise DockUnavailable(
                        f"etcd {self.endpoints} unreachable for {self.retry_s:.0f}s: {exc}{hint}"
                    ) from exc
                self._current += 1  # next endpoint
                self._local.client = None
                time.sleep(delay)
                delay = min(delay * 2, 1.0)

    def key(self, *parts: object) -> str:
        return "/" + "/".join([self.job, *(str(p) for p in parts)])

    # -- operations -----------------------------------------------------------------------
    def put(self, key: str, value: bytes, ttl_s: int | None = None, lease=None) -> None:
        """Put; with ``ttl_s`` under a new lease, with ``lease`` under that one."""
        if ttl_s is not None:
            self._call(lambda c: c.put(key, value, lease=c.lease(ttl_s)))
        else:
            self._call(lambda c: c.put(key, value, lease=lease))

    def lease(self, ttl_s: int) -> "StoreLease":
        """A new lease; keep it alive with ``lease.refresh()`` (returns the TTL, <= 0 once expired)."""
        return StoreLease(self._call(lambda c: c.lease(ttl_s)).id, self)

    def get(self, key: str) -> bytes | None:
        got = self._call(lambda c: c.get(key))
        return got[0] if got else None

    def wait_for(self, key: str, timeout_s: float) -> bytes | None:
        """``key``'s value once it exists, None after ``timeout_s``; read with a backoff from
        20 ms to 0.5 s, because at start every rank of the world waits for some key at once."""
        deadline, delay = time.monotonic() + timeout_s, 0.02
        while (raw := self.get(key)) is None:
            if time.monotonic() > deadline:
                return None
            time.sleep(delay)
            delay = min(2 * delay, 0.5)
        return raw

    def get_prefix(self, prefix: str) -> list[tuple[str, bytes]]:
        """All (key, value) under ``prefix``, sorted by key."""
        got = self._call(lambda c: c.get_prefix(prefix, sort_order="ascend", sort_target="key"))
        return [(meta["key"].decode(), value) for value, meta in got]

    def get_prefix_at(self, prefix: str) -> tuple[int, list[tuple[str, bytes, int]]]:
        """(store revision of the read, [(key, value, create revision)] sorted by key): a
        consistent snapshot that a watch from ``revision + 1`` continues without gap or overlap."""

        def op(c: Etcd3Client) -> dict:
            return c.post(
                c.get_url("/kv/range"),
                json={
                    "key": _encode(prefix),
                    "range_end": _encode(_increment_last_byte(prefix)),
                    "sort_order": "ASCEND",
                    "sort_target": "KEY",
                },
            )

        got = self._call(op)
        kvs = [
            (_decode(kv["key"]).decode(), _decode(kv.get("value", "")), int(kv["create_revision"]))
            for kv in got.get("kvs", [])
        ]
        return int(got["header"]["revision"]), kvs

    def delete_prefix(self, prefix: str) -> None:
        self._call(lambda c: c.delete_prefix(prefix))

    def delete(self, key: str) -> None:
        self._call(lambda c: c.delete(key))

    def create(self, key: str, value: bytes) -> bool:
        """Put only if the key does not exist; True when this call created it."""
        return bool(self._call(lambda c: c.create(key, value)))

    def replace(self, key: str, expected: bytes, new: bytes) -> bool:
        """Compare-and-swap: set ``new`` only if the value is ``expected``."""
        return bool(self._call(lambda c: c.replace(key, expected, new)))

    def watch_prefix(
        self, prefix: str, start_revision: int | None = None, puts_only: bool = False
    ) -> tuple[Iterator[dict], Callable[[], None]]:
        """(events, cancel): events are etcd3gw event dicts with ``kv`` and ``type`` (absent for a
        put); ``start_revision`` replays from that revision; ``puts_only``: etcd does not send
        deletes at all (its ``NODELETE`` filter). The events end when the watch does (etcd gone
        or restarted, the watch canceled, ``cancel()``): see ``WatchStream``."""
        create: dict = {"key": _encode(prefix), "range_end": _encode(_increment_last_byte(prefix))}
        if start_revision is not None:
            create["start_revision"] = start_revision
        if puts_only:
            create["filters"] = ["NODELETE"]

        def op(c: Etcd3Client) -> WatchStream:
            response = c.session.post(
                c.get_url("/watch"), json={"create_request": create}, stream=True, timeout=(self._timeout, None)
            )
            if response.status_code != requests.codes.ok:  # as etcd3gw's own calls: retried like them
                response.close()
                raise Etcd3Exception(response.text, response.reason)
            return WatchStream(response)

        stream = self._call(op)
        return iter(stream), stream.cancel

    def healthy(self) -> bool:
        try:
            self._client().status()
            return True
        except _TRANSIENT:
            return False
