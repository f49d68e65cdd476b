"""dock.host_pool and dock.buffer_pool_bytes: the in-process path's copies reuse freed buffers.

Invariants: a buffer is never handed out while a tensor that views it is alive; a freed buffer
of the same size class is reused and costs no new page faults (counted with getrusage, not
timed); the pool never keeps more idle bytes than its bound, and a bound of 0 keeps none; the
data a dock returns is the same with and without the pool, across iterations that reuse it.
"""

from __future__ import annotations

import contextlib
import gc
import mmap
import resource
import threading

import torch

from spmd_rl.config.layout import Layout
from spmd_rl.config.schema import DockConfig
from spmd_rl.dock.client import TransferDock
from spmd_rl.dock.fetch import Peer
from spmd_rl.dock.columns import ColumnSpec
from spmd_rl.dock.host_pool import HostPool, size_class
from spmd_rl.dock.metadata import MetadataStore

MiB = 1 << 20


def faults() -> int:
    """Minor page faults of this thread only: another thread of the test process (a warehouse
    of another test, an etcd client) cannot move it. The measured fills run single-threaded
    (``one_thread``), so no intra-op thread can take a fault this count would miss."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


@contextlib.contextmanager
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def test_size_classes_bound_the_slack():
    for n in (1, 4095, 4097, 1 << 20, (1 << 20) + 1, 3 * MiB + 7, 1 << 30):
        c = size_class(n)
        assert c >= n and c % 4096 == 0
        assert c <= max(4096, n * 9 // 8 + 4096)
    assert size_class(MiB + 1) == MiB + MiB // 8


def test_live_buffers_are_never_shared_and_freed_ones_are_reused():
    pool = HostPool(64 * MiB)
    a = pool.empty(4 * MiB // 4, torch.float32).fill_(1.0)
    b = pool.empty(4 * MiB // 4, torch.float32).fill_(2.0)  # a is alive: a second region
    assert pool.mapped == 2 and a.data_ptr() != b.data_ptr()
    view = a[10:20]
    del a
    gc.collect()
    assert pool.idle_bytes == 0, "a view keeps its buffer out of the pool"
    del view
    assert pool.idle_bytes == size_class(4 * MiB)
    with one_thread():
        before = faults()
        c = pool.empty(4 * MiB // 4, torch.float32).fill_(3.0)
        reused_faults = faults() - before
        # pages never touched: an anonymous mapping of its own (torch.empty may get memory that
        # an earlier test in this process freed to malloc, already mapped)
        fresh = torch.frombuffer(mmap.mmap(-1, 4 * MiB), dtype=torch.float32)
        before = faults()
        fresh.fill_(5.0)
        fresh_faults = faults() - before
    assert fresh_faults > 256, f"the counter sees this thread's faults ({fresh_faults} for 4 MiB of fresh pages)"
    assert reused_faults < 16, "a reused buffer's pages are already mapped"
    assert pool.reused == 1 and torch.equal(b, torch.full_like(b, 2.0)) and c.sum().item() == 3.0 * c.numel()
    d = pool.empty(4 * MiB // 4, torch.float32).fill_(4.0)  # c holds the only freed region
    assert pool.mapped == 3 and pool.idle_bytes == 0 and d.data_ptr() != c.data_ptr()
    assert c.sum().item() == 3.0 * c.numel()


def test_idle_bytes_stay_within_the_bound_and_zero_keeps_none():
    pool = HostPool(6 * MiB)
    bufs = [pool.empty(MiB, torch.uint8) for _ in range(10)]
    del bufs
    assert pool.idle_bytes == 6 * MiB
    none = HostPool(0)
    x = none.empty(4 * MiB, torch.uint8)
    del x
    assert none.idle_bytes == 0 and none.mapped == 0


def test_small_blocks_and_dtypes():
    pool = HostPool(64 * MiB)
    small = pool.empty(1000, torch.float32)
    assert pool.mapped == 0 and small.numel() == 1000
    for dtype in (torch.bfloat16, torch.int32, torch.float64, torch.uint8):
        t = pool.empty(MiB, dtype)
        assert t.dtype == dtype and t.shape == (MiB,) and t.data_ptr() % 64 == 0


def test_a_memfd_pool_shares_every_buffer_and_closes_its_fd_with_the_last_view():
    """dock.same_node's buffers: a memfd of the given name whatever the size, reused like the
    others; one the pool does not keep closes its fd once no tensor views it."""
    import gc
    import os

    pool = HostPool(size_class(MiB), memfd_name="spmd-rl-dock-test")
    small, region = pool.region(100)
    assert region.fd >= 0 and os.readlink(f"/proc/self/fd/{region.fd}") == "/memfd:spmd-rl-dock-test (deleted)"
    assert os.fstat(region.fd).st_ino == region.ino and small.numel() == 100
    big = pool.empty(MiB // 4, torch.float32).fill_(2.0)
    del small, region
    gc.collect()
    assert pool.idle_bytes == size_class(100)  # the small one is kept: it fits the bound
    other, spare = pool.region(3 * MiB)  # exceeds the bound once freed: not kept
    fd = spare.fd
    del other, spare
    gc.collect()
    assert (
        not os.path.exists(f"/proc/self/fd/{fd}")
        or os.readlink(f"/proc/self/fd/{fd}") != "/memfd:spmd-rl-dock-test (deleted)"
    )
    assert big.sum().item() == 2.0 * big.numel()


def test_buffers_freed_in_other_threads_return_to_the_pool():
    pool = HostPool(64 * MiB)
    held = [pool.empty(MiB, torch.uint8) for _ in range(4)]
    workers = [threading.Thread(target=held.pop) for _ in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert pool.idle_bytes == 4 * size_class(MiB)


def run_iterations(etcd, job: str, pool_bytes: int, iterations: int = 3) -> tuple[list[dict], TransferDock]:
    specs = {
        "item": ColumnSpec("item", torch.float32, True, "rollout"),
        "score": ColumnSpec("score", torch.float32, False, "rollout"),
    }
    d = TransferDock(
        DockConfig(port=0, get_timeout_s=5.0, buffer_pool_bytes=pool_bytes),
        MetadataStore([etcd.endpoint], job=job),
        specs,
        Peer(0, 1, 0, 0, 1),
        "pool-test-token-0123456789abcdef",
    ).start()
    seen = []
    for it in range(iterations):
        g = torch.Generator().manual_seed(it)
        items = [torch.randn(int(n), generator=g) for n in torch.randint(60_000, 70_000, (16,), generator=g)]
        d.begin_iteration(it, 16)
        d.put("rollout", it, {"item": items, "score": torch.randn(16, generator=g)}, range(16))
        first = d.get("a", it, ["item", "score"], Layout(1, 1))
        first.columns["item"][0].fill_(-1.0)  # a reader's write reaches neither the store nor the next reader
        second = d.get("b", it, ["item"], Layout(1, 1))
        assert all(torch.equal(x, y) for x, y in zip(second.columns["item"], items))
        seen.append({"item": [x.clone() for x in second.columns["item"]], "score": torch.stack(first.columns["score"])})
        del first, second
        d.commit(it)
    return seen, d


def test_dock_returns_the_same_data_with_and_without_the_pool_and_reuses_buffers(etcd):
    pooled, d = run_iterations(etcd, "pool-on", 512 * MiB)
    plain, d0 = run_iterations(etcd, "pool-off", 0)
    try:
        for a, b in zip(pooled, plain):
            assert all(torch.equal(x, y) for x, y in zip(a["item"], b["item"])) and torch.equal(a["score"], b["score"])
        pool = d._clients[0].pool
        assert pool.reused > 0 and pool.mapped <= 3, "iterations after the first reuse the first one's buffers"
        assert d0._clients[0].pool.reused == 0 and d0._clients[0].pool.mapped == 0
    finally:
        d.close()
        d0.close()
