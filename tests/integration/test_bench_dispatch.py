"""The dispatch benchmark runs end to end (loopback, tiny sizes) and its warehouse byte counts
follow the paper's Eqs. (2) and (4) exactly for the data part, with and without the in-process path. Times are printed,
not asserted."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from spmd_rl.recipe.estimates import tcv_centralized, tcv_per_warehouse
from tests.conftest import REPO, subprocess_env


@pytest.mark.slow
def test_bench_dispatch_bytes_follow_eq2_eq4(tmp_path):
    out = tmp_path / "bench.json"
    args = ["--nodes", "2", "--G", "8", "--N", "2", "--PL", "16", "--SL", "32", "--json", str(out)]
    res = subprocess.run(
        [sys.executable, str(REPO / "tools/bench_dispatch.py"), *args],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "ratio centralized / distributed" in res.stdout
    results = json.loads(out.read_text())["results"]
    gb = 1024**3
    eq2 = tcv_centralized(8, 2, 4, 16, 32, 5, 3) * gb
    eq4 = tcv_per_warehouse(8, 2, 4, 16, 32, 5, 3, C=0, S=2) * gb
    assert list(results["centralized"]["warehouse_bytes"].values()) == [eq2]
    assert list(results["distributed"]["warehouse_bytes"].values()) == [eq4, eq4]
    # the in-process path to a rank's own warehouse counts the same bytes as the wire
    assert results["distributed-wire"]["warehouse_bytes"] == results["distributed"]["warehouse_bytes"]


@pytest.mark.slow
def test_bench_dispatch_tp_leader_fetch_sends_each_remote_byte_once(tmp_path):
    """Separated-like flow (only node 0 writes), 2 nodes x 2 ranks, readers in TP groups of 2.
    Without the relay node 1's two TP ranks each read their share from node 0; with it node 0
    serves that share once and node 1's warehouse takes it in once and serves it once to the
    other TP rank, so node 0's bytes drop by exactly half of node 1's."""
    out = tmp_path / "bench.json"
    args = [
        "--nodes",
        "2",
        "--nproc-per-node",
        "2",
        "--train-tp",
        "2",
        "--writer-nodes",
        "1",
        "--relay-min-bytes",
        "0",
        "--G",
        "8",
        "--N",
        "2",
        "--PL",
        "16",
        "--SL",
        "64",
        "--iterations",
        "2",
        "--modes",
        "distributed-norelay,distributed",
        "--json",
        str(out),
    ]
    res = subprocess.run(
        [sys.executable, str(REPO / "tools/bench_dispatch.py"), *args],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "ratio distributed-norelay / distributed dispatch time (TP leader fetch)" in res.stdout
    results = json.loads(out.read_text())["results"]
    plain, relay = results["distributed-norelay"]["warehouse_bytes"], results["distributed"]["warehouse_bytes"]
    assert plain["2"] == 0 and relay["2"] > 0
    assert plain["0"] - relay["0"] == relay["2"] / 2
