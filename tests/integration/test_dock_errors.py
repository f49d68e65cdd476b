"""Bad requests to a real dock (real etcd process, real warehouse server, one process):
each is refused with a message naming the problem, and nothing stored before is lost. The
dock's own warehouse is reached both in process (``dock.local``) and over the wire, and both
refuse alike."""

from __future__ import annotations

import pytest
import torch

from spmd_rl.config.layout import Layout
from spmd_rl.config.schema import DockConfig
from spmd_rl.recipe.graph import Stage
from spmd_rl.dock.client import TransferDock
from spmd_rl.dock.fetch import Peer
from spmd_rl.dock.columns import specs_of
from spmd_rl.recipe.columns import column_decls
from spmd_rl.dock.errors import DockRequestError, DockTimeout, DockUnavailable
from spmd_rl.dock.etcd_server import EmbeddedEtcd
from spmd_rl.dock.metadata import MetadataStore
from spmd_rl.dock.warehouse_client import WarehouseClient

TOKEN = "unit-test-token-0123456789abcdef"
STAGES = [Stage("actor_rollout", ("prompt_ids",), ("response_ids",)), Stage("reward", (), ("reward",))]
ONE = Layout(1, 1)


@pytest.fixture(params=[True, False], ids=["in-process", "wire"])
def dock(etcd, request):
    meta = MetadataStore([etcd.endpoint], job=f"errors-{request.node.name}".replace("[", "-").replace("]", ""))
    d = TransferDock(
        DockConfig(port=0, get_timeout_s=1.0),
        meta,
        specs_of(column_decls(STAGES)),
        Peer(0, 1, 0, 0, 1),
        TOKEN,
        in_process=request.param,
    ).start()
    d.begin_iteration(0, 4)
    yield d
    d.close()


def ids(*lens):
    return [torch.arange(n, dtype=torch.int32) for n in lens]


def test_put_get_round_trip(dock):
    dock.put("data", 0, {"prompt_ids": ids(1, 2, 3, 4)}, [0, 1, 2, 3])
    b = dock.get("actor_rollout", 0, ["prompt_ids"], ONE)
    assert b.indices.tolist() == [0, 1, 2, 3]
    assert [v.tolist() for v in b.columns["prompt_ids"]] == [list(range(n)) for n in (1, 2, 3, 4)]
    td = b.padded()
    assert td["prompt_ids"].shape == (4, 4) and td["prompt_ids_length"].tolist() == [1, 2, 3, 4]
    assert b.jagged("prompt_ids").is_nested


def test_unknown_column(dock):
    with pytest.raises(
        DockRequestError,
        match="unknown column 'logits'.*known columns: answer, prompt_ids, prompt_row, response_ids, reward",
    ):
        dock.put("x", 0, {"logits": ids(1)}, [0])
    with pytest.raises(DockRequestError, match="unknown column"):
        dock.get("x", 0, ["logits"], ONE)


def test_index_out_of_range(dock):
    with pytest.raises(DockRequestError, match=r"indices \[4\] out of range \[0, 4\)"):
        dock.put("data", 0, {"prompt_ids": ids(1)}, [4])


def test_dtype_and_shape_mismatch(dock):
    with pytest.raises(DockRequestError, match="must be torch.int32, got torch.int64"):
        dock.put("data", 0, {"prompt_ids": [torch.arange(3)]}, [0])
    with pytest.raises(DockRequestError, match="ragged"):
        dock.put("data", 0, {"prompt_ids": torch.zeros(1, 3, dtype=torch.int32)}, [0])
    with pytest.raises(DockRequestError, match=r"shape \[B, \]"):
        dock.put("reward", 0, {"reward": torch.zeros(2, 3)}, [0, 1])
    with pytest.raises(DockRequestError, match="2 samples for 1 indices"):
        dock.put("data", 0, {"prompt_ids": ids(1, 2)}, [0])


def test_failed_put_leaves_earlier_data_intact(dock):
    dock.put("data", 0, {"prompt_ids": ids(5, 6)}, [0, 1])
    # second column is bad: nothing of this put may be stored
    with pytest.raises(DockRequestError):
        dock.put("data", 0, {"prompt_ids": ids(7, 8), "reward": torch.zeros(2, dtype=torch.int64)}, [2, 3])
    with pytest.raises(DockRequestError, match="duplicate put"):
        dock.put("data", 0, {"prompt_ids": ids(9)}, [1])
    dock.put("data", 0, {"prompt_ids": ids(7, 8)}, [2, 3])  # the refused put stored nothing
    b = dock.get("actor_rollout", 0, ["prompt_ids"], ONE)
    assert [v.numel() for v in b.columns["prompt_ids"]] == [5, 6, 7, 8]


def test_timeout_names_missing_indices_and_writer(dock):
    dock.put("data", 0, {"prompt_ids": ids(1, 1)}, [0, 1])
    with pytest.raises(DockTimeout, match=r"'prompt_ids' \(written by stage data\): missing 2-3 \(2 indices\)"):
        dock.get("actor_rollout", 0, ["prompt_ids"], ONE, timeout_s=0.3)
    with pytest.raises(DockTimeout, match=r"'reward' \(written by stage reward\): missing 0-1 \(2 indices\)"):
        dock.get("advantage", 0, ["prompt_ids", "reward"], ONE, timeout_s=0.3, expected=[0, 1])


def test_wrong_token_refused_and_counted(dock):
    intruder = WarehouseClient(dock.server.address, "not-the-token", timeout_s=5)
    with pytest.raises(DockRequestError, match="wrong job token"):
        intruder.get(0, [0], ["prompt_ids"])
    intruder.close()
    assert dock.warehouse_stats()["refused"] == 1


def test_commit_frees_data_and_metadata(dock):
    dock.put("data", 0, {"prompt_ids": ids(3, 3, 3, 3)}, [0, 1, 2, 3])
    assert dock.warehouse_stats()["samples"] == 4
    dock.commit(0)
    assert dock.warehouse_stats()["samples"] == 0
    assert dock.meta.get_prefix(dock.meta.key(0) + "/") == []
    with pytest.raises(DockRequestError, match="not started"):
        dock.put("data", 0, {"prompt_ids": ids(1)}, [0])


def test_embedded_etcd_stops_cleanly():
    e = EmbeddedEtcd().start()
    pid = e.proc.pid
    e.stop()
    from spmd_rl.dock.etcd_server import pid_alive

    assert not pid_alive(pid)


def test_lost_rank_fails_fast_instead_of_waiting(etcd):
    from spmd_rl.dock.errors import DockUnavailable

    meta = MetadataStore([etcd.endpoint], job="errors-lost-rank")
    d = TransferDock(
        DockConfig(port=0, get_timeout_s=60), meta, specs_of(column_decls(STAGES)), Peer(0, 2, 0, 0, 2), TOKEN
    ).start(heartbeat_ttl_s=2)
    try:
        d.begin_iteration(0, 4)
        import time

        t0 = time.monotonic()
        with pytest.raises(DockUnavailable, match=r"rank\(s\) \[1\] lost"):  # rank 1 never came up
            d.get("actor_rollout", 0, ["prompt_ids"], Layout(1, 2))  # the liveness path, not DockTimeout after 60 s
        print(f"lost rank detected by the get in {time.monotonic() - t0:.1f} s")
    finally:
        d.close()


@pytest.mark.timeout(120)
def test_fetch_from_a_lost_warehouse_fails_at_once(etcd):
    """Node 0's warehouse thread stops while its rank lives: a fetch from it fails within a
    couple of seconds naming the node, not after dock.get_timeout_s (600 s)."""
    import time

    meta = MetadataStore([etcd.endpoint], job="lost-warehouse")
    cfg = DockConfig(port=0, get_timeout_s=600)
    a = TransferDock(cfg, meta, specs_of(column_decls(STAGES)), Peer(0, 2, 0, 0, 1), TOKEN).start(heartbeat_ttl_s=3)
    b = TransferDock(cfg, meta, specs_of(column_decls(STAGES)), Peer(1, 2, 1, 0, 1), TOKEN).start(heartbeat_ttl_s=3)
    try:
        for d in (a, b):
            d.begin_iteration(0, 2)
        a.put("data", 0, {"prompt_ids": ids(1, 2)}, [0, 1])
        a.server._stop.set()  # the serve thread ends; rank 0 itself is still alive
        a.server._thread.join(timeout=10)
        t0 = time.monotonic()
        with pytest.raises(DockUnavailable, match="warehouse of node 0 .* is lost"):
            b.get("actor_rollout", 0, ["prompt_ids"], Layout(1, 2))  # one DP group of both ranks
        print(f"lost warehouse detected by the fetch in {time.monotonic() - t0:.1f} s")
    finally:
        b.close()
        a.close()
