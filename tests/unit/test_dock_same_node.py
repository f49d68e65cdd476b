"""A rank on its warehouse's node that does not serve it (``dock.same_node`` / ``dock.shm``).

Invariants: the same data, byte counts (Eq. (4)) and refusals as the wire, with the payload off
the socket; no write by a caller reaches stored data; small payloads stay inline; a warehouse
that cannot use the rank's memory leaves it on the wire with the same results; no request,
whatever buffer it names, stops the warehouse, changes stored data or writes into a file that is
not this job's memfd; another process on the node (a real local rank) gets and puts through it.
"""

from __future__ import annotations

import multiprocessing as mp
import os

import msgpack
import pytest
import torch

from spmd_rl.dock.auth import job_key, seal
from spmd_rl.dock.errors import DockRequestError
from spmd_rl.dock.host_pool import HostPool
from spmd_rl.dock.same_node import SameNodeWarehouse
from spmd_rl.dock.shm import SHM_MIN_BYTES, memfd_name
from spmd_rl.dock.warehouse import WarehouseServer
from spmd_rl.dock.warehouse_client import WarehouseClient
from spmd_rl.dock.wire import WireError, encode

TOKEN = "same-node-test-token-0123456789ab"
MAX_MSG = 4 << 20


def columns(seed: int, n: int = 24) -> dict[str, list[torch.Tensor]]:
    """A ragged int32 column, a ragged bf16 column and a fixed [3] float64 column: about 200 KiB."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(100, 2000, (n,), generator=g).tolist()
    return {
        "ids": [torch.randint(0, 2**31 - 1, (k,), generator=g, dtype=torch.int32) for k in lengths],
        "logp": [torch.randn(k, generator=g).bfloat16() for k in lengths],
        "adv": [torch.randn(3, generator=g, dtype=torch.float64) for _ in lengths],
    }


RAGGED = {"ids": True, "logp": True, "adv": False}


def new_server() -> WarehouseServer:
    return WarehouseServer(
        "127.0.0.1", 0, TOKEN, bucket_bytes=64 << 10, max_message_bytes=MAX_MSG, pool_bytes=64 << 20
    ).start()


@pytest.fixture
def server():
    s = new_server()
    yield s
    s.stop()


def flow(client: WarehouseClient, it: int) -> dict:
    """Put the columns, read them back in another order, then the refusals."""
    cols = columns(0)
    idx = list(range(len(cols["ids"])))
    client.put(it, idx, cols, RAGGED)
    order = idx[::-1]
    got = client.get(it, order, list(cols))
    for name, values in cols.items():
        for k, i in enumerate(order):
            assert got[name][k].dtype == values[i].dtype and torch.equal(got[name][k], values[i]), (name, i)
    refusals = []
    for bad in (
        lambda: client.put(it, [0], {"ids": [cols["ids"][0].repeat(40)]}, {"ids": True}),  # duplicate, 300 KiB
        lambda: client.put(it + 1, [0], {"ids": [torch.zeros(SHM_MIN_BYTES, dtype=torch.complex64)]}, {"ids": True}),
        lambda: client.put(it + 1, [0], {"ids": [torch.zeros(MAX_MSG // 4 + 1, dtype=torch.int32)]}, {"ids": True}),
    ):
        with pytest.raises((DockRequestError, WireError)) as err:
            bad()
        refusals.append(f"{type(err.value).__name__}: {str(err.value).split(': ', 1)[-1][-50:]}")
    return {"refusals": refusals, "got": got}


def test_same_data_counts_and_refusals_as_the_wire():
    """The same flow on two fresh warehouses, one reached over the wire, one through memory."""
    servers = [new_server(), new_server()]
    wire = WarehouseClient(servers[0].address, TOKEN, max_message_bytes=MAX_MSG)
    near = SameNodeWarehouse(servers[1].address, TOKEN, 64 << 20, max_message_bytes=MAX_MSG)
    counts, results = {}, {}
    for name, client, server in (("wire", wire, servers[0]), ("near", near, servers[1])):
        results[name] = flow(client, 1)
        stats = server.store.stats()
        counts[name] = (stats["bytes_in"], stats["bytes_out"])
    payload = sum(t.numel() * t.element_size() for vals in columns(0).values() for t in vals)
    assert counts["wire"] == counts["near"] == (payload, payload)  # Eq. (4)'s bytes, whichever path
    assert results["wire"]["refusals"] == results["near"]["refusals"]
    assert "duplicate put" in results["near"]["refusals"][0] and "WireError" in results["near"]["refusals"][1]
    assert "put fewer samples at once" in results["near"]["refusals"][2]
    assert near.shared and near.shm_bytes == 2 * payload
    assert near.bytes_sent + near.bytes_received < 64 << 10 < wire.bytes_sent  # the payload never took the socket
    # the samples returned are views of one buffer of this rank's pool
    got = results["near"]["got"]
    assert got["ids"][0].untyped_storage().data_ptr() == got["adv"][0].untyped_storage().data_ptr()
    wire.close()
    near.close()
    for server in servers:
        server.stop()


def test_small_payloads_stay_inline_and_no_caller_write_reaches_the_store(server):
    near = SameNodeWarehouse(server.address, TOKEN, 64 << 20)
    small = [torch.arange(5, dtype=torch.int32), torch.arange(3, dtype=torch.int32)]
    near.put(0, [0, 1], {"ids": small}, {"ids": True})
    assert near.get(0, [1, 0], ["ids"])["ids"][1].tolist() == [0, 1, 2, 3, 4] and near.shm_bytes == 0
    cols = columns(7)
    idx = list(range(len(cols["ids"])))
    near.put(3, idx, cols, RAGGED)
    for t in cols["ids"]:
        t.fill_(-1)  # the writer reuses its buffers
    first = near.get(3, idx, ["ids"])["ids"]
    for t in first:
        t.fill_(-7)  # a reader writes into what it got
    fresh = columns(7)["ids"]
    assert all(torch.equal(a, b) for a, b in zip(near.get(3, idx, ["ids"])["ids"], fresh))
    assert near.shm_bytes > 0
    near.close()


def test_a_warehouse_that_cannot_use_the_memory_leaves_the_rank_on_the_wire(server, caplog):
    near = SameNodeWarehouse(server.address, TOKEN, 64 << 20)
    near.pool = HostPool(64 << 20, memfd_name="spmd-rl-dock-another-job")  # not this job's buffers
    cols = columns(3)
    idx = list(range(len(cols["ids"])))
    near.put(0, idx, cols, RAGGED)  # refused through memory, then done over the wire
    assert not near.shared and near.shm_bytes == 0 and "using the wire from now on" in caplog.text
    got = near.get(0, idx, list(cols))
    assert all(torch.equal(a, b) for a, b in zip(got["logp"], cols["logp"]))
    assert server.store.stats()["bytes_in"] == sum(t.numel() * t.element_size() for v in cols.values() for t in v)
    near.close()


def _hostile_refs(tmp_path) -> tuple[list, tuple]:
    """Buffers a request could name: another file of this process, pid 1, a closed fd, this
    job's memfd with a wrong inode or too small, bad types and ranges."""
    victim = tmp_path / "checkpoint.bin"
    victim.write_bytes(b"keep me" * 100_000)
    fd = os.open(victim, os.O_RDWR)
    small, region = HostPool(0, memfd_name=memfd_name(job_key(TOKEN))).region(4096)
    me = os.getpid()
    refs = [
        {"pid": me, "fd": fd, "ino": os.fstat(fd).st_ino, "capacity": 1 << 30},
        {"pid": 1, "fd": 0, "ino": 0, "capacity": 1 << 30},
        {"pid": me, "fd": 987654, "ino": 1, "capacity": 1 << 30},
        {"pid": me, "fd": region.fd, "ino": region.ino + 1, "capacity": 1 << 30},
        {"pid": me, "fd": region.fd, "ino": region.ino, "capacity": 1 << 30},  # claims more than its 4 KiB
        {"pid": -1, "fd": True, "ino": "x", "capacity": -5},
        {"pid": 2**63, "fd": 0, "ino": 0},
        "a string",
        None,
    ]
    return refs, (victim, fd, small, region)


def test_no_buffer_a_request_names_stops_the_warehouse_or_writes_elsewhere(server, tmp_path):
    key = job_key(TOKEN)
    keep = columns(11)
    idx = list(range(len(keep["ids"])))
    WarehouseClient(server.address, TOKEN, max_message_bytes=MAX_MSG).put(0, idx, keep, RAGGED)
    refs, (victim, fd, small, region) = _hostile_refs(tmp_path)
    raw = WarehouseClient(server.address, TOKEN, timeout_s=10)
    put_cols = {
        "ids": {
            "ragged": True,
            "lengths": [SHM_MIN_BYTES // 4],
            "dtype": "int32",
            "shape": [SHM_MIN_BYTES // 4],
            "offset": 0,
        }
    }
    for ref in refs:
        for header in (
            {"op": "get", "iter": 0, "indices": idx, "columns": ["ids", "logp"], "shm": ref},
            {"op": "put", "iter": 0, "indices": [99], "columns": put_cols, "shm": ref},
            {
                "op": "put",
                "iter": 0,
                "indices": [98],
                "columns": {"ids": {"ragged": True, "dtype": "int32", "shape": [2**40], "offset": 2**47}},
                "shm": ref,
            },
        ):
            with pytest.raises(DockRequestError) as err:
                raw.request(header)
            assert err.value.kind in ("PeerMemoryError", "DockRequestError", "WireError")
    # a put must not make the warehouse allocate bytes the rank does not hold: no overlapping
    # columns, no sparse buffer (1 GiB long, nothing resident)
    sparse = os.memfd_create(memfd_name(key), os.MFD_CLOEXEC)
    os.ftruncate(sparse, 1 << 30)
    mib = {"ragged": True, "lengths": [MAX_MSG // 4], "dtype": "int32", "shape": [MAX_MSG // 4], "offset": 0}
    for cols, fd_, ino, why in (
        ({"a": mib, "b": mib}, region.fd, region.ino, "overlap"),
        ({"a": mib}, sparse, os.fstat(sparse).st_ino, "in memory"),
    ):
        with pytest.raises(DockRequestError, match=why):
            raw.request(
                {
                    "op": "put",
                    "iter": 0,
                    "indices": [97],
                    "columns": cols,
                    "shm": {"pid": os.getpid(), "fd": fd_, "ino": ino},
                }
            )
    os.close(sparse)
    frames = seal(key, b"req", encode({"op": "get", "iter": 0, "indices": idx, "columns": ["ids"], "shm": refs[0]}, []))
    raw._sock.send_multipart(frames)  # the same, raw, for good measure
    assert raw._sock.poll(5000) and b"PeerMemoryError" in raw._sock.recv_multipart()[-1]
    assert server.serving() and victim.read_bytes() == b"keep me" * 100_000
    assert bytes(region.mm[:64]) == bytes(64)  # a buffer too small for the reply was not written either
    got = raw.get(0, idx, list(keep))
    assert all(torch.equal(a, b) for name in keep for a, b in zip(got[name], keep[name]))
    assert not {97, 98, 99} & set(server.store.data[0]["ids"])
    assert msgpack.packb(server.store.stats())  # still answers
    os.close(fd)
    raw.close()


def _local_rank_1(address: str, out) -> None:
    near = SameNodeWarehouse(address, TOKEN, 64 << 20, max_message_bytes=MAX_MSG)
    cols = columns(5)
    idx = list(range(len(cols["ids"])))
    got = near.get(0, idx, list(cols))
    same = all(torch.equal(a, b) for name in cols for a, b in zip(got[name], cols[name]))
    near.put(1, idx, cols, RAGGED)
    out.put((same, near.shared, near.shm_bytes))
    near.close()


@pytest.mark.timeout(120)
def test_another_process_on_the_node_uses_its_memory(server):
    cols = columns(5)
    idx = list(range(len(cols["ids"])))
    server.store.put(0, idx, cols, RAGGED)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_local_rank_1, args=(server.address, out))
    proc.start()
    same, shared, moved = out.get(timeout=100)
    proc.join(timeout=30)
    payload = sum(t.numel() * t.element_size() for v in cols.values() for t in v)
    assert same and shared and moved == 2 * payload
    stored, _ = server.store.get(1, idx, list(cols))
    assert all(torch.equal(a, b) for name in cols for a, b in zip(stored[name], cols[name]))
