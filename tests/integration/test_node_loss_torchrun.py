"""Node loss wherever it lands, with the default timeouts: two simulated nodes (the README's
example, ``launch/multi_node.sh``, --nnodes 1:2, etcd-v2 rendezvous). The surviving node is
paused (by tests/helpers/faults) at a point of an iteration after the first checkpoint, the
other node is SIGKILLed (agent and worker), and the survivor carries on into that point:
generation, the reward stage's fetch, the update, and a checkpoint write. Each time it must
re-form a world of 1, re-derive both layouts, resume from the latest checkpoint and train again
(a new iteration logged with world 1); the node is then started again and the world grows back
to 2 (after the last point too). At the end both agents exit 0, the run finished with world 2,
no iteration is missing and the final checkpoint loads.

The recovery times are printed (the goal is 30 s; torchrun keeps the lost node in its
rendezvous until it missed three keep-alives, ``KEEP_ALIVE_S``, set to 2 s here: alone on a
2-core AMD EPYC with AVX2 only the recoveries took 15.7-17.5 s, the survivor's restarts forked
from the suite's preload servers); a benchmark, not this test, judges them. The test asserts the
mechanism that separates a liveness-bounded wait from a timeout-bounded one: after every kill
the survivor noticed the lost peer itself, through its liveness key (exit status 75) or the
peer's closed connection (gloo's "Connection reset by peer" inside a collective), and no
collective or dock wait timed out.

Invariant: every blocking wait is bounded by the liveness of the peer it waits on
(dock.heartbeat.PeerWatch, liveness-bounded fetches and metadata waits), not by a global
timeout such as dock.get_timeout_s (600 s) or elastic.collective_timeout_s (60 s)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from spmd_rl.dock.etcd_server import EmbeddedEtcd
from spmd_rl.train import PEER_LOST_EXIT
from spmd_rl.trainer.checkpoint import complete_checkpoints, model_weights
from tests.conftest import _PRELOAD
from tests.torchrun_util import kill_node, metric_rows, node_agent, preloaded_copies, wait_for

ITERS = 16
POINTS = ["generate", "reward_fetch", "update", "checkpoint"]


def node(tmp: Path, etcd: str, name: str, faults: dict | None = None):
    args = [
        "configs/quickstart.yaml",
        "parallel.train.dp_shard=null",
        "parallel.gen.dp=null",
        "parallel.nnodes=2",
        "parallel.nproc_per_node=1",
        "elastic.max_nodes=2",
        "dock.port=0",
        "logging.progress=false",
        "data.global_batch_size=8",
        "rollout.n=4",
        "actor.mini_batch_size=8",
        "actor.micro_batch_size=8",
        f"trainer.iterations={ITERS}",
        f"checkpoint.dir={tmp}/ckpt",
        "checkpoint.interval=2",
        f"logging.dir={tmp}/logs",
    ]
    # torchrun drops a silent node from the rendezvous after 3 missed keep-alives: 6 s, not 15
    env = {"JOB": "node-loss", "KEEP_ALIVE_S": "2"}
    if faults:
        env["SPMD_RL_TEST_FAULTS"] = json.dumps(faults)
    return node_agent(tmp, etcd, name, args, env)


def _paused_at(faults: Path, point: str) -> bool:
    """A live worker paused at ``point``: its ``.reached`` names a running pid. An incarnation
    released from the point before can reach the next one and write its ``.reached`` just
    before the liveness path ends it; its successor rewrites the file when it gets there."""
    try:
        pid = json.loads((faults / f"{point}.reached").read_text())["pid"]
    except (OSError, ValueError):  # not there yet, or being written
        return False
    try:
        return bool(Path(f"/proc/{pid}/cmdline").read_bytes())  # empty for a zombie
    except OSError:
        return False


@pytest.mark.slow
# Eight restarts of the survivor (each kill, each regrow). When its fault plan kept it from the
# preload servers, on a 2-core AMD EPYC with AVX2 only beside the learning tests, each took
# about 66 s (exit to resumed; imports most of it) and the test passed pyproject's 900 s hang
# guard at its last kill; forked, the test took 196 s alone there. The guard stays at 1,800 s
# for a run without the servers (SPMD_RL_TEST_PRELOAD=0); the test's own waits bound every
# phase (400 s a pause point, 120 s a restart, 300 s a regrow, 600 s the end).
@pytest.mark.timeout(1800)
def test_survivor_leaves_through_the_liveness_path_and_trains_again_wherever_the_kill_lands(tiny_model, tmp_path):
    faults = tmp_path / "faults"
    faults.mkdir()
    (faults / "hold").write_text("")
    metrics = tmp_path / "logs/metrics.jsonl"
    rows = lambda: metric_rows(metrics)  # noqa: E731

    def logged_since(wall: float, world: int) -> bool:
        """An iteration with this world size was logged after ``wall`` (a resumed run
        rewrites the file from its checkpoint, so position in the file proves nothing)."""
        got = rows()
        return bool(got) and got[-1]["world"] == world and metrics.stat().st_mtime > wall

    recovery: dict[str, tuple[float, float]] = {}
    exits: dict[str, str] = {}  # what the survivor printed between the kill and its restart
    with EmbeddedEtcd() as etcd:
        a = node(
            tmp_path, etcd.endpoint, "a", {"kind": "pause", "dir": str(faults), "points": POINTS, "min_iteration": 3}
        )
        b = node(tmp_path, etcd.endpoint, "b0")
        try:
            for k, point in enumerate(POINTS):
                wait_for(lambda: _paused_at(faults, point) or a.poll() is not None, 400, f"the survivor at {point}")
                assert a.poll() is None, (tmp_path / "a.log").read_text()[-4000:]
                # with the suite's preload servers, the paused survivor is a forked copy (seen in its
                # /proc environ): its fault plan once kept it from asking, and each of its restarts
                # imported for itself
                pid = str(json.loads((faults / f"{point}.reached").read_text())["pid"])
                forked = any(line.split()[0] == pid for line in preloaded_copies())
                assert forked or not _PRELOAD.sockets, f"the survivor at {point} imported by itself"
                log_at = len((tmp_path / "a.log").read_text())
                kill_node(b)
                killed, killed_wall = time.monotonic(), time.time()
                (faults / f"{point}.go").write_text("")
                wait_for(
                    lambda: (
                        "training from iteration" in (tmp_path / "a.log").read_text()[log_at:] or a.poll() is not None
                    ),
                    120,
                    f"the survivor restarting after the kill at {point}",
                )
                restarted = time.monotonic() - killed
                exits[point] = (tmp_path / "a.log").read_text()[log_at:]
                wait_for(
                    lambda: logged_since(killed_wall, world=1) or a.poll() is not None,
                    120,
                    f"the survivor training alone after the kill at {point}",
                )
                recovery[point] = (restarted, time.monotonic() - killed)
                assert a.poll() is None, (tmp_path / "a.log").read_text()[-4000:]
                b = node(tmp_path, etcd.endpoint, f"b{k + 1}")
                started = time.time()
                wait_for(lambda: logged_since(started, world=2), 300, "the world growing back to 2")
            assert a.wait(timeout=600) == 0, (tmp_path / "a.log").read_text()[-4000:]
            assert b.wait(timeout=120) == 0, (tmp_path / f"b{len(POINTS)}.log").read_text()[-4000:]
        finally:
            for p in (a, b):
                if p.poll() is None:
                    kill_node(p)
    report = ", ".join(f"{p}: restarted {r:.1f} s, trained {t:.1f} s" for p, (r, t) in recovery.items())
    print(
        f"node loss recovery (kill -> survivor restarted, kill -> next iteration logged): {report}; "
        f"worst {max(t for _, t in recovery.values()):.1f} s"
    )
    assert sorted({r["iteration"] for r in rows()}) == list(range(ITERS))  # nothing skipped
    # world 1's iterations were redone by the grown world (a resume rewrites the log from its
    # checkpoint); that it trained is the per-kill check above
    assert {r["world"] for r in rows()} == {2}
    assert (tmp_path / "a.log").read_text().count("resumed from") >= len(POINTS)  # never from scratch
    assert complete_checkpoints(tmp_path / "ckpt")[-1].name == f"iter_{ITERS:06d}"
    assert model_weights(tmp_path / "ckpt" / f"iter_{ITERS:06d}")
    noticed = (f"exiting (status {PEER_LOST_EXIT})", "Connection reset by peer", "Connection closed by peer")
    for point, text in exits.items():
        assert any(s in text for s in noticed), (
            f"{point}: the survivor did not notice the lost peer itself:\n{text[-3000:]}"
        )
        # messages and log lines start at column 0; a traceback's indented frame lines name
        # files and source (spmd_rl/distributed/timeouts.py, ``with generation_phase():``) that
        # say "timeout" without anything having timed out
        said = "\n".join(line for line in text.splitlines() if not line.startswith(" "))
        assert not re.search(r"timed out|timeout", said, re.I), f"{point}: a wait timed out:\n{text[-3000:]}"
