"""The in-process path to a rank's own warehouse (``dock.local``), against the wire path in the
same process (real etcd, real warehouse servers): same data, same byte counts, same refusals;
no write by a caller reaches stored data; a stopped warehouse fails the path at once; the
server thread keeps serving remote peers while the rank uses the store directly."""

from __future__ import annotations

import threading

import pytest
import torch

from spmd_rl.config.layout import Layout
from spmd_rl.config.schema import DockConfig
from spmd_rl.recipe.graph import Stage
from spmd_rl.dock.client import TransferDock
from spmd_rl.dock.fetch import Peer
from spmd_rl.dock.columns import ColumnSpec, specs_of
from spmd_rl.recipe.columns import column_decls
from spmd_rl.dock.errors import DockRequestError, DockUnavailable
from spmd_rl.dock.local import InProcessWarehouse
from spmd_rl.dock.metadata import MetadataStore
from spmd_rl.dock.warehouse import WarehouseServer
from spmd_rl.dock.warehouse_client import WarehouseClient
from spmd_rl.dock.wire import WireError

TOKEN = "unit-test-token-0123456789abcdef"
STAGES = [Stage("actor_rollout", ("prompt_ids",), ("response_ids",)), Stage("reward", (), ("reward",))]
ONE = Layout(1, 1)


def make_dock(etcd, job: str, in_process: bool, **cfg) -> TransferDock:
    specs = specs_of(column_decls(STAGES)) | {"odd": ColumnSpec("odd", torch.complex64, True, "data")}
    meta = MetadataStore([etcd.endpoint], job=job)
    d = TransferDock(
        DockConfig(port=0, get_timeout_s=2.0, **cfg), meta, specs, Peer(0, 1, 0, 0, 1), TOKEN, in_process=in_process
    ).start()
    d.begin_iteration(0, 7)
    return d


def counting(server: WarehouseServer) -> list[int]:
    """Count the requests the server thread handles (wraps its ``_handle``)."""
    seen, handle = [0], server._handle

    def counted(frames, peer, ident=None):
        seen[0] += 1
        return handle(frames, peer, ident)

    server._handle = counted
    return seen


def flow(d: TransferDock) -> dict:
    """One small sample flow; returns what was read and the warehouse's counts."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 100, (n,), generator=g, dtype=torch.int32) for n in (3, 1, 4, 1, 5, 9)]
    d.put("data", 0, {"prompt_ids": prompts}, range(6))
    d.put("actor_rollout", 0, {"response_ids": [p * 2 for p in prompts[:3]]}, [0, 1, 2])
    d.put("actor_rollout", 0, {"response_ids": [p * 3 for p in prompts[3:]]}, [3, 4, 5])
    d.put("reward", 0, {"reward": torch.arange(6, dtype=torch.float32) / 7}, range(6))
    refusals = []
    for bad in (
        lambda: d.put("data", 0, {"prompt_ids": prompts[:1]}, [2]),  # duplicate
        lambda: d.put("data", 0, {"odd": [torch.zeros(2, dtype=torch.complex64)]}, [0]),  # no wire dtype
        lambda: d.put("data", 0, {"prompt_ids": [torch.zeros(5000, dtype=torch.int32)]}, [6]),
    ):  # 20,000 bytes > 16 KiB
        with pytest.raises((DockRequestError, WireError)) as err:
            bad()
        refusals.append(f"{type(err.value).__name__}: {str(err.value)[-60:]}")
    batch = d.get("advantage", 0, ["prompt_ids", "response_ids", "reward"], ONE, expected=list(range(6)))
    return {
        "columns": {k: [v.tolist() for v in vals] for k, vals in batch.columns.items()},
        "stats": {k: d.warehouse_stats()[k] for k in ("bytes_in", "bytes_out", "samples", "bytes_out_by_iter")},
        "refusals": refusals,
    }


@pytest.mark.timeout(120)
def test_same_data_counts_and_refusals_as_the_wire(etcd):
    results = {}
    for in_process in (True, False):
        d = make_dock(etcd, f"local-same-{in_process}", in_process, max_message_bytes=1 << 14)
        try:
            handled = counting(d.server)
            results[in_process] = flow(d)
            assert isinstance(d.client(0), InProcessWarehouse) is in_process
            # the in-process rank sends its server nothing but the stats it asks for
            assert (handled[0] == 0) if in_process else handled[0] > 5
        finally:
            d.close()
    assert results[True] == results[False]
    assert results[True]["stats"]["bytes_out"] > 0 and "WireError" in results[True]["refusals"][1]
    assert "put fewer samples at once" in results[True]["refusals"][2]


@pytest.mark.timeout(120)
def test_no_caller_write_reaches_the_store(etcd):
    d = make_dock(etcd, "local-owned", True)
    try:
        mine = [torch.arange(4, dtype=torch.int32), torch.arange(2, dtype=torch.int32)]
        reward = torch.tensor([0.5, 1.5])
        d.put("data", 0, {"prompt_ids": mine}, [0, 1])
        d.put("reward", 0, {"reward": reward}, [0, 1])
        for t in (*mine, reward):
            t.fill_(-1)  # the writer reuses its buffers
        first = d.get("advantage", 0, ["prompt_ids", "reward"], ONE, expected=[0, 1])
        for vals in first.columns.values():
            for t in vals:
                t.fill_(-7)  # a reader writes into what it got
        again = d.get("advantage2", 0, ["prompt_ids", "reward"], ONE, expected=[0, 1])
        assert [t.tolist() for t in again.columns["prompt_ids"]] == [[0, 1, 2, 3], [0, 1]]
        assert [t.item() for t in again.columns["reward"]] == [0.5, 1.5]
    finally:
        d.close()


@pytest.mark.timeout(120)
def test_a_stopped_warehouse_fails_the_in_process_path(etcd):
    d = make_dock(etcd, "local-stopped", True)
    try:
        d.put("data", 0, {"prompt_ids": [torch.arange(3, dtype=torch.int32)]}, [0])
        d.server._stop.set()
        d.server._thread.join(timeout=10)
        with pytest.raises(DockUnavailable, match="warehouse of node 0 .* is lost .*during get"):
            d.get("actor_rollout", 0, ["prompt_ids"], ONE, expected=[0])
        with pytest.raises(DockUnavailable, match="is lost .*during put"):
            d.put("data", 0, {"prompt_ids": [torch.arange(3, dtype=torch.int32)]}, [1])
    finally:
        d.close()


@pytest.mark.timeout(120)
def test_remote_peers_are_served_while_the_rank_uses_the_store(etcd):
    """A remote peer's puts (server thread) and the rank's own puts (in process) interleave on
    one store: every sample lands once and every byte is counted once."""
    d = make_dock(etcd, "local-concurrent", True)
    n = 200
    d.begin_iteration(0, 2 * n)
    peer = WarehouseClient(d.server.address, TOKEN, timeout_s=30)
    errors = []

    def remote():
        try:
            for i in range(n, 2 * n):
                peer.put(0, [i], {"prompt_ids": [torch.full((8,), i, dtype=torch.int32)]}, {"prompt_ids": True})
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    t = threading.Thread(target=remote)
    t.start()
    try:
        local = d.client(0)
        for i in range(n):
            local.put(0, [i], {"prompt_ids": [torch.full((8,), i, dtype=torch.int32)]}, {"prompt_ids": True})
        t.join(timeout=60)
        assert not errors
        got = local.get(0, list(range(2 * n)), ["prompt_ids"])["prompt_ids"]
        assert [int(v[0]) for v in got] == list(range(2 * n)) and all(v.numel() == 8 for v in got)
        stats = local.stats()
        assert stats["samples"] == 2 * n and stats["bytes_in"] == 2 * n * 8 * 4 == stats["bytes_out"]
    finally:
        peer.close()
        d.close()
