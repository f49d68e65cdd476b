"""The dock's control plane as the cluster grows, counted by etcd itself
(``tools/bench_control_plane.py``: the real dock of S simulated nodes x 4 ranks, the stage graph
of a GRPO run with a reference, one real etcd; issue [6/6]).

What a broken dock would show here: a wait that polls etcd (reads per rank that grow with S), a
put that re-reads every record, a liveness check that reads the world's keys every second, a
record watch that also streams the commit's deletes, a metadata write per sample instead of one
per stage and rank, or a survivor that never hears of a lost node. Counts, not times: the
numbers below are what etcd's own ``/metrics`` says it served."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "tools"))
import bench_control_plane as bench  # noqa: E402

NODES, K, GEN_TP, TTL, GROUP = (4, 8, 16), 4, 4, 10, 4


def expected_writes(ranks: int) -> int:
    """Metadata writes of one iteration, from the stage graph: one put-record per writing rank
    of each stage that has outputs (the generation layout's TP rank 0 of each DP group, every
    rank of the training layout), the data loader's put on each generation DP group, and the
    commit's one delete of the iteration's keys."""
    f = bench.flow(bench.parse(["--N", "16"]))
    per_layout = {"gen": ranks // GEN_TP, "train": ranks}
    return per_layout["gen"] + sum(per_layout[s.layout] for s in f["graph"] if s.outputs) + 1


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("cp") / "rows.json"
    cmd = [sys.executable, str(REPO / "tools/bench_control_plane.py"), "--nodes", ",".join(map(str, NODES))]
    cmd += ["--nproc-per-node", str(K), "--gen-tp", str(GEN_TP), "--heartbeat-ttl-s", str(TTL)]
    cmd += ["--idle-s", "4", "--kill-node", "--records-group-nodes", str(GROUP), "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())["rows"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_metadata_writes_are_one_per_stage_and_writing_rank_and_etcd_agrees_with_the_clients(rows):
    for r in rows:
        R = r["ranks"]
        assert r["etcd_writes_per_it"] == expected_writes(R), r["nodes"]
        assert r["client_dispatch/writes_per_it"] + r["client_liveness/writes_per_it"] == r["etcd_writes_per_it"]
        client_reads = r["client_dispatch/reads_per_it"] + r["client_liveness/reads_per_it"]
        assert abs(client_reads - r["etcd_reads_per_it"]) <= 0.02 * r["etcd_reads_per_it"] + 1


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_reads_and_watches_per_rank_stay_flat_as_the_cluster_grows(rows):
    """One read of the iteration's records and one watch per *group of nodes* and iteration
    (the group's first warehouse follows etcd for the group's warehouses, each of them for its
    node's ranks, ``dock.feed_host``), plus at most one read and watch per TP follower of a
    relayed get (``dock.relay``), whatever S. The polling dock read 16-31 times per rank, more
    as S grew; a feed per rank read and watched once per rank, a feed per node once per node."""
    for r in rows:
        R, S = r["ranks"], r["nodes"]
        groups = -(-S // GROUP)
        relay_followers = R - R // GEN_TP
        assert r["etcd_reads_per_it"] <= groups + relay_followers, r
        assert r["etcd_watches_per_it"] <= groups + relay_followers, r
        # each record reaches each group's watch once (not each node's), and the commit's deletes none
        records = r["etcd_writes_per_it"] - 1
        assert r["etcd_watch_events_per_it"] <= groups * records + relay_followers, r
    assert rows[-1]["etcd_reads_per_it"] / rows[-1]["ranks"] <= rows[0]["etcd_reads_per_it"] / rows[0]["ranks"] + 0.5


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_healthy_world_costs_etcd_one_keep_alive_per_node_and_second(rows):
    """Between iterations: no reads at all (the peer watch follows the liveness keys through
    watches), no writes, and one keep-alive per *node* and second (``dock.node_lease``: the
    node's ranks and warehouse ride on its lead's lease). A lease per rank and per warehouse
    cost R + S keep-alives a second (1.25 R here)."""
    for r in rows:
        S = r["nodes"]
        assert r["etcd_reads_per_s_idle"] == 0, r
        assert r["client_liveness/reads_per_s_idle"] == 0, r
        assert r["etcd_writes_per_s_idle"] == 0, r
        assert 0.7 * S <= r["etcd_keepalives_per_s_idle"] <= 1.1 * S, r


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_survivor_hears_of_a_killed_node_and_none_before_its_lease_could_expire(rows):
    loss = rows[-1]["loss"]
    assert loss is not None  # the tool exits non-zero unless every surviving rank reported it
    assert loss["first_s"] >= TTL - 1.5, loss  # no rank is declared lost while its lease holds


def test_the_cost_model_recovers_known_coefficients():
    """``fit`` on rows made from known per-iteration costs gets them back, and ``extrapolate``
    evaluates them at the rank counts asked."""
    rows = []
    for R in (16, 32, 64, 128):
        rows.append(
            {
                "ranks": R,
                "nodes": R // 4,
                "etcd_writes_per_it": 4.5 * R + 1,
                "etcd_reads_per_it": 1.0 * R,
                "etcd_watch_events_per_it": 4.5 * R * R,
                "etcd_sent_bytes_per_it": 300.0 * R * R + 2000 * R,
                "etcd_etcd_cpu_s_per_it": 2e-6 * R * R + 3e-3 * R,
                "etcd_keepalives_per_s_idle": R / 4,
            }
        )
    model = bench.fit(rows)
    # float64 least squares on exact data (this and the next 3 lines): cond ~1e4 x eps 2.2e-16 << rel 1e-6; abs 1e-6
    # where a coefficient is 0
    assert model["etcd_writes_per_it"] == pytest.approx([4.5, 1.0])
    assert model["etcd_watch_events_per_it"] == pytest.approx([4.5, 0.0], abs=1e-6)
    assert model["etcd_etcd_cpu_s_per_it"] == pytest.approx([2e-6, 3e-3])
    assert model["keepalives_per_node_s"] == pytest.approx([1.0])
    (at,) = bench.extrapolate(model, None, 100.0, [1024], ranks_per_node=8)
    # the fitted coefficients (rel ~1e-12) evaluated at 1024 ranks (this and the next 2 lines); approx's default
    assert at["writes_s"] == pytest.approx((4.5 * 1024 + 1) / 100)
    assert at["etcd_cpu_share"] == pytest.approx((2e-6 * 1024**2 + 3e-3 * 1024) / 100)
    assert at["keepalives_s"] == pytest.approx(1024 / 8)  # one lease per node of 8 ranks
