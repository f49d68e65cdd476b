"""A node's loss in the trainer: elastic replicas (``elastic.replicas``) against the restart path,
at each kill point, in the same run on the same machine. Both train the tiny model (HF rollout
engine by default, ``--engine vllm`` for vLLM; G=8, N=4, one mini-batch, a checkpoint every
iteration) on two simulated nodes of one rank each against one embedded etcd:

- restart (the baseline): one job over two nodes (``launch/multi_node.sh``: torchrun, etcd-v2
  rendezvous, --nnodes 1:2). The survivor is paused at the kill point (``tests/helpers/faults``),
  the other node SIGKILLed (agent and worker) and the survivor released: it leaves through the
  liveness path, torchrun re-forms a world of one and a new worker resumes from the latest
  checkpoint;
- replicas: two replicas, one ``spmd-rl train`` each. The victim is paused at the kill point and
  SIGKILLed (launcher, agent, worker); the survivor's next cross-replica collective fails, it
  agrees on a generation alone and redoes the iteration in the same process.

Kill points: the start of generation, of the reward stage's fetch, of the reference log-probs
and of the update; ``commit`` (replicas only, compared with the restart at the update): after the
gradient's all-reduce over the replicas, before the commit vote; inside a checkpoint write; and
``update_stopped`` (replicas only): the victim's worker SIGSTOPped at the update, not killed.
Times from the kill: "training again" (restart: the new worker logs "training from iteration";
replicas: the survivor logs "redoing iteration"), "next iteration" (the survivor logs an
iteration finished after the kill) and whether the survivor's worker kept its pid; and the
survivor's generation stage before the loss, in the redo (whose groups it had generated already
come from memory) and after it. Median of ``--runs``. Run from the repository root:
``python tools/bench_replica_trainer.py``."""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from spmd_rl.dock.etcd_server import EmbeddedEtcd

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.torchrun_util import descendants, kill_node, kill_tree, metric_rows, node_agent, wait_for  # noqa: E402

POINTS = ["generate", "reward_fetch", "reference", "update", "commit", "checkpoint", "update_stopped"]
BASELINE = {"commit": "update", "update_stopped": "update"}
"""The restart path has no commit vote (nor a SIGSTOP run here): its update point is the comparison."""
TRAIN = [
    "configs/quickstart.yaml",
    "rollout.max_response_length=8",
    "data.global_batch_size=8",
    "rollout.n=4",
    "actor.mini_batch_size=8",
    "actor.micro_batch_size=8",
    "trainer.iterations=1000",
    "algorithm.kl_coef=0.001",  # a reference stage to kill in
    "checkpoint.interval=1",
    "checkpoint.keep=2",
    "logging.progress=false",
    "dock.port=0",
]
"""What both modes train (they never reach the last iteration: the bench stops them)."""


def _env(faults: dict | None = None) -> dict[str, str]:
    env = dict(os.environ) | {
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests/helpers/faults'}",
    }
    env.pop("SPMD_RL_TEST_FAULTS", None)
    return env | ({"SPMD_RL_TEST_FAULTS": json.dumps(faults)} if faults else {})


def _after(path: Path, offset: int, text: str) -> bool:
    return path.exists() and text in path.read_text(errors="replace")[offset:]


def _worker_pid(launcher: subprocess.Popen) -> int | None:
    return next(
        (p for p, args in descendants(launcher.pid) if "spmd_rl.train" in args and "torch.distributed" not in args),
        None,
    )


def restart_loss(tmp: Path, etcd: str, point: str) -> dict[str, float]:
    """The baseline at ``point`` (module docstring)."""
    faults = tmp / "faults"
    faults.mkdir(parents=True)
    args = TRAIN + [
        "parallel.nnodes=2",
        "parallel.nproc_per_node=1",
        "parallel.train.dp_shard=null",
        "parallel.gen.dp=null",
        "elastic.max_nodes=2",
        f"checkpoint.dir={tmp}/ckpt",
        f"logging.dir={tmp}/logs",
    ]
    plan = {"kind": "pause", "dir": str(faults), "points": [point], "min_iteration": 2}
    common = {"JOB": tmp.name, "KEEP_ALIVE_S": "2", "PYTHONPATH": _env()["PYTHONPATH"], "OMP_NUM_THREADS": "1"}
    a = node_agent(tmp, etcd, "a", args, common | {"SPMD_RL_TEST_FAULTS": json.dumps(plan)})
    b = node_agent(tmp, etcd, "b", args, common)
    try:
        wait_for(lambda: (faults / f"{point}.reached").exists(), 600, f"the survivor at {point}")
        before = _worker_pid(a)
        offset = len((tmp / "a.log").read_text(errors="replace"))
        kill_node(b)  # (it waits for the agent: b.poll() is set after)
        t0, wall = time.monotonic(), time.time()
        (faults / f"{point}.go").write_text("")
        again = wait_for(lambda: _after(tmp / "a.log", offset, "training from iteration"), 300, "the restart")
        metrics = tmp / "logs/metrics.jsonl"
        wait_for(
            lambda: metrics.exists() and metrics.stat().st_mtime > wall and metric_rows(metrics)[-1]["world"] == 1,
            300,
            "an iteration after the restart",
        )
        return {"again": again, "next": time.monotonic() - t0, "same_pid": float(_worker_pid(a) == before)}
    finally:
        for node in (a, b):
            if node.poll() is None:
                kill_node(node)


def replica_loss(tmp: Path, etcd: str, point: str) -> dict[str, float]:
    """Elastic replicas at ``point`` (module docstring); ``update_stopped``: the victim's worker
    is SIGSTOPped at the update instead (its sockets stay open: the survivor's collective times
    out after ``elastic.replicas.timeout_s``, 5 s by default)."""
    faults = tmp / "faults"
    faults.mkdir(parents=True)
    stop = point.endswith("_stopped")
    point = point.removesuffix("_stopped")
    plan = {"kind": "pause", "dir": str(faults), "points": [point], "min_iteration": 2, "world": 1}
    args = [
        *TRAIN,
        "parallel.nproc_per_node=1",
        "parallel.train.dp_shard=1",
        "parallel.gen.dp=1",
        f"checkpoint.dir={tmp}/ckpt",
        f"logging.dir={tmp}/logs",
        f"metadata.job={tmp.name}",
        f"metadata.endpoints=[{etcd}]",
        "dock.token=bench-replica-trainer-token",
        "elastic.max_restarts=0",
        "elastic.replicas.count=2",
    ]
    procs = {
        n: subprocess.Popen(
            [sys.executable, "-m", "spmd_rl.cli", "train", *args, f"elastic.replicas.name={n}"],
            cwd=REPO,
            env=_env(plan if n == "v" else None),
            stdout=subprocess.DEVNULL,
            stderr=open(tmp / f"{n}.log", "w"),
        )
        for n in ("s", "v")  # the survivor, the victim
    }
    seen: list = []
    try:
        wait_for(lambda: (faults / f"{point}.reached").exists(), 600, f"the victim at {point}")
        before = _worker_pid(procs["s"])
        metrics = tmp / "logs/s/metrics.jsonl"
        offset, rows = len((tmp / "s.log").read_text(errors="replace")), len(metric_rows(metrics))
        seen = descendants(procs["v"].pid)
        if stop:
            os.kill(json.loads((faults / f"{point}.reached").read_text())["pid"], signal.SIGSTOP)
        else:
            kill_tree(procs["v"])
        t0 = time.monotonic()
        again = wait_for(lambda: _after(tmp / "s.log", offset, "redoing iteration"), 300, "the survivor's redo")
        wait_for(lambda: len(metric_rows(metrics)) > rows, 300, "the survivor's next iteration")
        nxt = time.monotonic() - t0
        wait_for(lambda: len(metric_rows(metrics)) > rows + 1, 300, "the survivor's iteration after the redo")
        before_row, redo, after = metric_rows(metrics)[rows - 1 : rows + 2]
        return {
            "again": again,
            "next": nxt,
            "same_pid": float(_worker_pid(procs["s"]) == before),
            "reused": redo["replica_reused_groups"],
            "gen_before": before_row["time_actor_rollout"],
            "gen_redo": redo["time_actor_rollout"],
            "gen_after": after["time_actor_rollout"],
        }
    finally:
        for p in procs.values():
            kill_tree(p, seen)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--points", nargs="+", default=POINTS, choices=POINTS)
    ap.add_argument("--engine", default="hf", choices=["hf", "vllm"], help="the rollout engine both modes use")
    ap.add_argument("--replicas-only", action="store_true", help="skip the restart baseline runs")
    args = ap.parse_args()
    TRAIN.append(f"rollout.engine={args.engine}")
    tmp = Path(tempfile.mkdtemp(prefix="bench-replica-trainer-"))
    cpu = next((x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo") if x.startswith("model name")), "")
    got: dict[tuple[str, str], list[dict]] = {}
    with EmbeddedEtcd() as etcd:
        for k in range(args.runs):
            for point in args.points:
                runs = [("replicas", replica_loss, point)]
                if point not in BASELINE and not args.replicas_only:
                    runs.insert(0, ("restart", restart_loss, point))
                for mode, fn, at in runs:
                    got.setdefault((point, mode), []).append(fn(tmp / f"{mode}-{point}-{k}", etcd.endpoint, at))
                    print(point, mode, got[(point, mode)][-1], flush=True)
    print(
        f"\n# {cpu or platform.machine()}, {os.cpu_count()} CPUs; two nodes of one rank; rollout.engine={args.engine}; "
        f"median of {args.runs}"
    )
    print(
        f"{'kill point':13} {'mode':9} {'training again s':>17} {'next iteration s':>17} {'same pid':>9} "
        f"{'next / restart':>15}"
    )
    for point in args.points:
        base = statistics.median(r["next"] for r in got.get((BASELINE.get(point, point), "restart"), [{"next": 0}]))
        for mode in ("restart", "replicas"):
            if (point, mode) not in got:
                continue
            rs = got[(point, mode)]
            again, nxt = statistics.median(r["again"] for r in rs), statistics.median(r["next"] for r in rs)
            same = all(r["same_pid"] for r in rs)
            ratio = f"{nxt / base:15.2f}" if base else f"{'-':>15}"
            print(f"{point:13} {mode:9} {again:17.2f} {nxt:17.2f} {'yes' if same else 'no':>9} {ratio}")
    _generation_table(args.points, got)


def _generation_table(points: list[str], got: dict) -> None:
    """The survivor's generation stage in the same run: its last iteration before the loss (its
    share: half the batch), the redo (the whole batch, its own half taken from memory,
    ``replica_reused_groups``) and the iteration after (the whole batch, all generated)."""
    print(
        f"\n{'kill point':13} {'reused groups':>13} {'gen before s':>13} {'gen redo s':>11} {'gen after s':>12} "
        f"{'redo / after':>13}"
    )
    for point in points:
        rs = got.get((point, "replicas"))
        if not rs:
            continue
        med = {k: statistics.median(r[k] for r in rs) for k in ("reused", "gen_before", "gen_redo", "gen_after")}
        print(
            f"{point:13} {med['reused']:13.0f} {med['gen_before']:13.2f} {med['gen_redo']:11.2f} "
            f"{med['gen_after']:12.2f} {med['gen_redo'] / med['gen_after']:13.2f}"
        )


if __name__ == "__main__":
    main()
