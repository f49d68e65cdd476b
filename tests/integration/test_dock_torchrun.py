"""The dock across 4 real ranks on 2 simulated nodes (two torchrun agents on loopback) with a
real etcd: generation DP=4 writes, training DP=2 (TP=2) reads; both dock modes. Responses are
long enough that the ranks which do not serve their node's warehouse move their payloads
through shared memory (``dock.same_node``). ``relay``: only node 0's ranks write, so training
DP group 1 (node 1) finds its whole share remote and its TP leader fetches it for both
(``dock.relay``, ``dock.tp_relay_min_bytes: 0``), with every byte still bit-exact."""

from __future__ import annotations

import json

import pytest

from tests.conftest import REPO
from tests.torchrun_util import QUIET_CHILD_ENV, run_nodes

G, N, RLEN = 8, 4, 3000


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["distributed", "centralized", "relay"])
def test_gen_dp4_writes_train_dp2_reads(etcd, tmp_path, mode):
    relay = mode == "relay"
    mode = "distributed" if relay else mode
    env = (
        QUIET_CHILD_ENV
        | {
            "SPMD_RL_ETCD": etcd.endpoint,
            "SPMD_RL_OUT": str(tmp_path),
            "DOCK_MODE": mode,
            "G": str(G),
            "N": str(N),
            "GEN_TP": "1",
            "TRAIN_TP": "2",
            "RLEN": str(RLEN),
        }
        | ({"WRITERS": "2", "RELAY_MIN": "0"} if relay else {})
    )
    run_nodes(REPO / "tests/helpers/dock_worker.py", nnodes=2, nproc_per_node=2, env=env, log_dir=tmp_path)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert [r["node"] for r in ranks] == [0, 0, 1, 1]
    assert all(r["mismatches"] == 0 for r in ranks)  # every byte of every column bit-exact
    # TP peers of a training DP group read the same share; the two DP groups split all indices
    assert ranks[0]["indices"] == ranks[1]["indices"] and ranks[2]["indices"] == ranks[3]["indices"]
    a, b = set(ranks[0]["indices"]), set(ranks[2]["indices"])
    assert not a & b and a | b == set(range(G * N)) and len(a) == len(b) == G * N // 2
    # group-granular stage: whole prompt groups of N, none split
    for r in (ranks[0], ranks[2]):
        prompts = {i // N for i in r["grouped"]}
        assert sorted(r["grouped"]) == sorted(i for p in prompts for i in range(p * N, (p + 1) * N))
    assert set(ranks[0]["grouped"]) | set(ranks[2]["grouped"]) == set(range(G * N))
    # token balance within one longest sample (prompt + response <= 11 + RLEN - 1)
    assert abs(ranks[0]["tokens"] - ranks[2]["tokens"]) <= 11 + RLEN - 1
    # the rank serving a warehouse reaches it in process; its node's other rank through shared memory
    serving = {0, 2} if mode == "distributed" else {0}
    for r in ranks:
        beside_a_warehouse = r["rank"] not in serving and (mode == "distributed" or r["node"] == 0)
        assert (r["shm_bytes"] > 0) if beside_a_warehouse else r["shm_bytes"] is None, r
    served = {r["rank"]: r["stats"]["bytes_out"] for r in ranks if r["stats"]}
    if mode == "distributed":
        assert set(served) == {0, 2} and all(v > 0 for v in served.values())
    else:
        assert set(served) == {0}
    # the TP leader fetch: group 1 (ranks 2, 3) got both stages' shares through rank 2; node 1's
    # warehouse took them in once (nothing else is written there) and served them to rank 3
    if relay:
        assert [r["relayed"] for r in ranks] == [[], [], ["actor_update", "advantage"], ["actor_update", "advantage"]]
        assert ranks[2]["stats"]["bytes_in"] > 0 and ranks[2]["stats"]["bytes_out"] >= ranks[2]["stats"]["bytes_in"]
    else:
        assert all(r["relayed"] == [] for r in ranks)
    # commit freed every warehouse and the iteration's metadata
    assert all(r.get("after_commit_samples", 0) == 0 for r in ranks)
    assert all(json.loads((tmp_path / f"meta{r}.json").read_text()) == 0 for r in range(4))
