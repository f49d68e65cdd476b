"""Elastic replicas in the trainer (``elastic.replicas``), each replica its own ``spmd-rl train``
(a torchrun job) against one real etcd: three replicas train one global batch; after their
first iteration all are held at iteration 1's start (``tests/helpers/faults``), one is
SIGKILLed (launcher, agent and rank) there, and a fourth is started (the survivors stay held
until it asked to join, so it joins at iteration 1 or 2 however long it takes to start). The
survivors keep their processes (each logs its start once), redo the interrupted iteration with
the prompts dealt over the new generation (each keeping the groups it had generated, generating
only the lost one's), take the new one in at an iteration's start (healed from a survivor:
weights, AdamW state, sampler, LR schedule, no checkpoint), train every prompt of every
iteration once (the replicas' prompt ledgers, merged, are the one job's, each prompt trained
once) and end bit-identical to each other, the joiner included, and, within float round-off,
equal to one job training the same global batch alone: the objective's split invariance across
replicas.

A second run kills a replica at the most delicate point, after the gradient's all-reduce over
the replicas and before the commit vote (``tests/helpers/faults``: it pauses there, then is
SIGKILLed): the survivors' vote fails, nobody steps, and they redo the iteration; the end is
again the one-job run's. One runs vLLM engines in the replicas (the survivor keeps its process
and engine and trains the one job's prompts once each). Another loses a replica while a joiner
heals (the heal fails on all, they agree again without it, the joiner heals again). One takes
several optimizer steps per iteration and loses a replica after the first was committed: the
survivors undo it and redo the iteration. A last run does it with replicas of two ranks each
(FSDP2 inside a replica, each shard reduced with the same shard of the other replica: HSDP's
column groups, the replica's ranks voting after each collective), with two mini-batches, against
one job of two ranks."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from spmd_rl.dock.metadata import MetadataStore
from spmd_rl.trainer.checkpoint import model_weights
from spmd_rl.trainer.ledger import PromptLedger, StepRecord, problems
from tests.conftest import REPO, subprocess_env
from tests.torchrun_util import descendants, kill_tree

ITERS, G, N = 5, 6, 2


def command(tmp: Path, etcd, *extra: str) -> list[str]:
    """``spmd-rl train`` of the tiny model, a deterministic run of ITERS iterations."""
    return [
        sys.executable,
        "-m",
        "spmd_rl.cli",
        "train",
        "configs/quickstart.yaml",
        f"checkpoint.dir={tmp}/ckpt",
        f"logging.dir={tmp}/logs",
        f"trainer.iterations={ITERS}",
        f"data.global_batch_size={G}",
        f"rollout.n={N}",
        f"actor.mini_batch_size={G}",
        "actor.micro_batch_size=2",
        "parallel.nproc_per_node=1",
        "parallel.train.dp_shard=1",
        "parallel.gen.dp=1",
        "rollout.engine=hf",
        "rollout.max_response_length=8",
        "trainer.deterministic=true",
        "checkpoint.interval=0",
        f"metadata.endpoints=[{etcd.endpoint}]",
        "dock.token=replicas-test-token",
        "logging.progress=false",
        "elastic.max_restarts=0",
        *extra,
    ]


def rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def solo(tiny_model, tmp_path_factory, etcd) -> dict[str, torch.Tensor]:
    """The final weights of one job training the global batch alone."""
    tmp = tmp_path_factory.mktemp("solo")
    one_job(tmp, etcd, "solo")
    return model_weights(tmp / f"ckpt/iter_{ITERS:06d}")


ENV = subprocess_env() | {"OMP_NUM_THREADS": "1"}


def one_job(tmp: Path, etcd, job: str, *extra: str) -> None:
    """One job (no replicas) training the global batch alone, to the end: the reference run."""
    done = subprocess.run(
        command(tmp, etcd, f"metadata.job={job}", *extra), cwd=REPO, env=ENV, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]


def replica(tmp: Path, etcd, job: str, name: str, faults: dict | None = None, *extra: str) -> subprocess.Popen:
    args = [f"metadata.job={job}", "elastic.replicas.count=3", *extra]  # the timeouts and lease users get
    env = ENV | ({"SPMD_RL_TEST_FAULTS": json.dumps(faults)} if faults else {})
    return subprocess.Popen(
        command(tmp, etcd, *args, f"elastic.replicas.name={name}"),
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(tmp.parent / f"{job}-{name}.err", "w"),
    )


def wait_while_running(done, procs: dict[str, subprocess.Popen], err: dict[str, Path]) -> None:
    """Until ``done()``; fails at once, with their logs, when a replica exits before."""
    deadline = time.monotonic() + 600
    while not done():
        assert time.monotonic() < deadline, "timed out"
        assert all(p.poll() is None for p in procs.values()), {n: err[n].read_text()[-2000:] for n in procs}
        time.sleep(0.05)


def ledger(etcd, job: str) -> list[StepRecord]:
    return PromptLedger(MetadataStore([etcd.endpoint], job=f"{job}.ledger")).read()


def assert_trained_once_as_one_job(etcd, job: str, names: str) -> None:
    """The replicas' prompt ledgers, merged by iteration: every prompt of every iteration
    trained exactly once (``ledger.problems``), and each iteration's prompts the one job's."""
    merged: dict[int, StepRecord] = {}
    for n in names:
        for r in ledger(etcd, f"{job}.{n}"):
            m = merged.setdefault(r.iteration, StepRecord(r.iteration, [], [], put=[], trained_samples=0, group_size=N))
            m.sampled, m.trained, m.put = m.sampled + r.sampled, m.trained + r.trained, m.put + r.put
            m.trained_samples += r.trained_samples
    assert sorted(merged) == list(range(ITERS)) and problems(list(merged.values())) == []
    assert {it: sorted(m.trained) for it, m in merged.items()} == {
        r.iteration: sorted(r.sampled) for r in ledger(etcd, "solo")
    }


def workers(launcher: subprocess.Popen) -> list[int]:
    """The rank processes below a replica's ``spmd-rl train``."""
    return [p for p, args in descendants(launcher.pid) if "spmd_rl.train" in args and "torch.distributed" not in args]


@contextlib.contextmanager
def reaped(procs: dict[str, subprocess.Popen]) -> Iterator[list]:
    """On the way out, SIGKILL every replica still running (those added meanwhile too) and the
    trees ``kill_replica`` killed, whose parents may be gone."""
    seen: list = []
    try:
        yield seen
    finally:
        for p in procs.values():
            kill_tree(p, seen)


def kill_replica(procs: dict[str, subprocess.Popen], name: str, seen: list) -> None:
    """SIGKILL a replica: its launcher, torchrun agent and ranks."""
    seen += descendants(procs[name].pid)
    kill_tree(procs[name])


def assert_matches_one_job(
    finals: list[dict[str, torch.Tensor]], solo: dict, tiny_model: Path, round_off: float = 1e-6
) -> None:
    """Every replica ends with the same bytes, within round-off of the one-job run."""
    assert all(torch.equal(finals[0][k], other[k]) for other in finals[1:] for k in solo)
    start = load_file(Path(tiny_model) / "model.safetensors")
    worst = max(float((finals[0][k].float() - solo[k].float()).abs().max()) for k in solo)
    moved = max(float((solo[k].float() - start[k].float()).abs().max()) for k in solo if k in start)
    print(f"largest difference from the one-job run: {worst:.3g} (the updates moved weights by up to {moved:.3g})")
    # float32: replicas sum gradients in another order; Adam (eps 1e-8) makes rounding-size gradients lr-ish steps
    assert worst <= round_off and moved > 1e-5  # replicas stepping on their own shares would differ by about `moved`


def asked_to_join(etcd, job: str, name: str) -> bool:
    store = MetadataStore([etcd.endpoint], job=job)
    return any(k.endswith(f"/{name}") for k, _ in store.get_prefix(store.key("elastic", "join") + "/"))


@pytest.mark.slow
def test_survivors_of_a_killed_replica_redo_its_iteration_and_match_one_job(tiny_model, tmp_path, etcd, solo):
    tmp, faults = tmp_path / "elastic", tmp_path / "faults"
    faults.mkdir()
    (faults / "hold").write_text("")  # all run iteration 0, then wait at the start of iteration 1's work
    hold = {"kind": "pause", "dir": str(faults), "points": [], "min_iteration": 0, "world": 1}
    procs = {n: replica(tmp, etcd, "elastic", n, hold) for n in "abc"}
    err = {n: tmp_path / f"elastic-{n}.err" for n in "abcd"}
    with reaped(procs) as seen:
        # all three wait inside iteration 1, past its start's collective: a and b meet c's loss after generating
        wait_while_running(lambda: len(list(faults.glob("held.*"))) == 3, procs, err)
        kill_replica(procs, "c", seen)
        procs["d"] = replica(tmp, etcd, "elastic", "d")
        wait_while_running(lambda: asked_to_join(etcd, "elastic", "d"), {"d": procs["d"]}, err)
        (faults / "hold").unlink()
        for n in "abd":
            assert procs[n].wait(timeout=600) == 0, err[n].read_text()[-3000:]
    logs = {n: rows(tmp / f"logs/{n}/metrics.jsonl") for n in "abcd"}
    joined = logs["d"][0]["iteration"]
    # in the redo of iteration 1 when a and b were held before they met c's loss, else at iteration 2's start
    assert joined in (1, 2), joined
    for n in "ab":
        assert [r["iteration"] for r in logs[n]] == list(range(ITERS))  # each once: nobody restarted
        assert [r["replicas"] for r in logs[n]] == [3] + [2] * (joined - 1) + [3] * (ITERS - joined)
        assert [r["replica_redone"] for r in logs[n]][:2] == [0, 1]  # the iteration c was in when it died
        # the redo generated only c's groups: each survivor took its own two from before the loss
        assert [r["replica_reused_groups"] for r in logs[n]] == [0, 2] + [0] * (ITERS - 2)
        text = err[n].read_text()
        assert text.count("training from iteration") == 1 and f"redoing iteration 1 with {4 - joined} replicas" in text
    assert [r["iteration"] for r in logs["d"]] == list(range(joined, ITERS))
    assert err["d"].read_text().count(f"training from iteration {joined} ") == 1
    # seen from the engine: a survivor asked it for 2 groups per iteration, 2 in the failed try, and in the
    # redo none (d took c's place at once) or c's one of its new 3 (d came at iteration 2); without the
    # memory it would ask for its whole share again
    killed = {p for p, _ in seen}  # c's processes
    asked = {
        pid: sum(int(k) for n, k in (x.split() for x in f.read_text().split("\n") if x) if int(n) == N)
        for f in faults.glob("generated.*")
        if (pid := int(f.suffix[1:])) not in killed
    }
    assert sorted(asked.values()) == [2 * ITERS + (joined == 2)] * 2, asked  # a and b (d runs no fault plan)
    for it in range(ITERS):  # every prompt's samples trained once, by the replicas of that iteration
        total = sum(r["samples"] for n in "abcd" for r in logs[n] if r["iteration"] == it)
        assert total == G * N, (it, total)
    assert_trained_once_as_one_job(etcd, "elastic", "abcd")
    assert_matches_one_job([model_weights(tmp / f"ckpt/{n}/iter_{ITERS:06d}") for n in "abd"], solo, tiny_model)


@pytest.mark.slow
@pytest.mark.parametrize("point", ["commit", "ledger"])
def test_a_replica_killed_between_the_gradient_and_the_commit_steps_nobody(tiny_model, tmp_path, etcd, solo, point):
    """c is SIGKILLed before its commit vote of iteration 1 (the survivors redo iteration 1), or
    after the vote passed and before it wrote its ledger record of it (``ledger``: iteration 1
    is committed and its share trained; the survivors lose c in iteration 2 and redo that one).
    Either way the merged ledgers hold every prompt of every iteration once, and the survivors
    end at the one job's weights. (Before, a kill at ``ledger`` left c's share of iteration 1 in
    no ledger.)"""
    job = f"{point}-kill"
    tmp, faults = tmp_path / job, tmp_path / "faults"
    faults.mkdir()
    plan = {"kind": "pause", "dir": str(faults), "points": [point], "min_iteration": 1, "world": 1}
    procs = {n: replica(tmp, etcd, job, n, plan if n == "c" else None) for n in "abc"}
    err = {n: tmp_path / f"{job}-{n}.err" for n in "abc"}
    with reaped(procs) as seen:
        wait_while_running((faults / f"{point}.reached").exists, procs, err)
        paused = json.loads((faults / f"{point}.reached").read_text())
        kill_replica(procs, "c", seen)
        assert paused["pid"] in [p for p, _ in seen]  # the paused rank was c's
        for n in "ab":
            assert procs[n].wait(timeout=600) == 0, err[n].read_text()[-3000:]
    redone = paused["iteration"] + (point == "ledger")
    logs = {n: rows(tmp / f"logs/{n}/metrics.jsonl") for n in "ab"}
    for n in "ab":
        assert [r["iteration"] for r in logs[n]] == list(range(ITERS))
        assert logs[n][redone]["replica_redone"] == 1 and logs[n][-1]["replicas"] == 2
        assert f"redoing iteration {redone} with 2 replicas" in err[n].read_text()
    assert ("recorded its share" in err["a"].read_text()) == (point == "ledger")
    assert_trained_once_as_one_job(etcd, job, "abc")
    assert_matches_one_job([model_weights(tmp / f"ckpt/{n}/iter_{ITERS:06d}") for n in "ab"], solo, tiny_model)


@pytest.mark.slow
def test_a_loss_after_a_committed_mini_batch_undoes_it_and_matches_one_job(tiny_model, tmp_path, etcd):
    """Several optimizer steps per iteration (two mini-batches of 3 groups, two epochs) with
    REINFORCE++ (token returns whitened over the whole batch): c is SIGKILLed before iteration
    1's second commit vote, after the first step was taken by all. The survivors put back the
    state the iteration started from (``IterationStart``) and redo it dealt over two (2 and 1
    units of each mini-batch), and end at the one job's weights: the steps taken before the loss
    are undone, each replica's mini-batch m is its part of the global mini-batch m, and the
    whitening's moments are the global batch's (summed over the replicas)."""
    steps = ("actor.mini_batch_size=3", "actor.ppo_epochs=2", "trainer.iterations=3", "algorithm.name=reinforce_pp")
    one_job(tmp_path / "solo4", etcd, "solo4", *steps)
    tmp, faults = tmp_path / "minis", tmp_path / "faults"
    faults.mkdir()
    plan = {"kind": "pause", "dir": str(faults), "points": ["commit"], "min_iteration": 1, "world": 1, "skip": 1}
    procs = {n: replica(tmp, etcd, "minis", n, plan if n == "c" else None, *steps) for n in "abc"}
    err = {n: tmp_path / f"minis-{n}.err" for n in "abc"}
    with reaped(procs) as seen:
        wait_while_running((faults / "commit.reached").exists, procs, err)
        assert json.loads((faults / "commit.reached").read_text())["iteration"] == 1
        kill_replica(procs, "c", seen)
        for n in "ab":
            assert procs[n].wait(timeout=600) == 0, err[n].read_text()[-3000:]
    logs = {n: rows(tmp / f"logs/{n}/metrics.jsonl") for n in "ab"}
    for n in "ab":
        assert [(r["iteration"], r["replicas"], r["replica_redone"]) for r in logs[n]] == [
            (0, 3, 0),
            (1, 2, 1),
            (2, 2, 1),
        ]
    assert [r["samples"] for r in logs["a"]] == [4, 8, 8] and [r["samples"] for r in logs["b"]] == [4, 4, 4]
    solo = model_weights(tmp_path / "solo4/ckpt/iter_000003")
    assert_matches_one_job([model_weights(tmp / f"ckpt/{n}/iter_000003") for n in "ab"], solo, tiny_model)


@pytest.mark.slow
def test_ppo_replicas_undo_the_critic_too_and_heal_a_joiner_with_it(tiny_model, tmp_path, etcd):
    """PPO (a critic, GAE whitened over the whole batch) with one optimizer step per iteration:
    c is SIGKILLed before iteration 1's second commit vote, the actor's, after the critic
    stepped; the survivors put the critic back and redo it, and d, started meanwhile, is healed
    with both models' weights and AdamW state. a, b and d end bit-identical, at the one job's
    weights. (Before, only iterations of several actor steps kept their start, and ``adopt``
    found every survivor's critic a step ahead: all of them died.)"""
    ppo = ("algorithm.name=ppo", "algorithm.critic_lr=1e-4", "trainer.iterations=3")
    one_job(tmp_path / "solo_ppo", etcd, "solo_ppo", *ppo)
    tmp, faults, at_commit = tmp_path / "ppo", tmp_path / "faults", tmp_path / "commit"
    faults.mkdir(), at_commit.mkdir()
    hold = {"kind": "pause", "dir": str(faults), "points": [], "min_iteration": 0, "world": 1}
    # the first commit vote labelled iteration 1 is the actor's of iteration 1 (a vote is labelled with the last
    # actor update started, so the critic's of iteration 1 still reads 0): the critic has stepped, the actor not
    plan = {"kind": "pause", "dir": str(at_commit), "points": ["commit"], "min_iteration": 1, "world": 1}
    procs = {n: replica(tmp, etcd, "ppo", n, plan if n == "c" else hold, *ppo) for n in "abc"}
    err = {n: tmp_path / f"ppo-{n}.err" for n in "abcd"}
    with reaped(procs) as seen:
        wait_while_running((at_commit / "commit.reached").exists, procs, err)
        (faults / "hold").write_text("")  # the survivors' redo waits until d asked to join
        kill_replica(procs, "c", seen)
        procs["d"] = replica(tmp, etcd, "ppo", "d", None, *ppo)
        wait_while_running(lambda: asked_to_join(etcd, "ppo", "d"), {n: procs[n] for n in "abd"}, err)
        (faults / "hold").unlink()
        for n in "abd":
            assert procs[n].wait(timeout=600) == 0, err[n].read_text()[-3000:]
    logs = {n: rows(tmp / f"logs/{n}/metrics.jsonl") for n in "abd"}
    assert json.loads((at_commit / "commit.reached").read_text())["iteration"] == 1
    assert logs["a"][1]["replica_redone"] == 1 and logs["d"][0]["iteration"] in (1, 2)
    assert all("value_loss" in r for r in logs["a"])  # the critic trained every iteration
    solo = model_weights(tmp_path / "solo_ppo/ckpt/iter_000003")
    assert_matches_one_job([model_weights(tmp / f"ckpt/{n}/iter_000003") for n in "abd"], solo, tiny_model)
    critics = [model_weights(tmp / f"ckpt/{n}/iter_000003/critic") for n in "abd"]
    solo_critic = model_weights(tmp_path / "solo_ppo/ckpt/iter_000003/critic")
    assert all(torch.equal(critics[0][k], c[k]) for c in critics[1:] for k in solo_critic)
    # float32 critic: the same round-off argument as assert_matches_one_job's 1e-6
    assert max(float((critics[0][k].float() - solo_critic[k].float()).abs().max()) for k in solo_critic) <= 1e-6


@pytest.mark.slow
def test_the_whole_job_relaunched_under_its_name_resumes_from_the_newest_checkpoint(tiny_model, tmp_path, etcd, solo):
    """Both replicas are SIGKILLed once they trained two iterations (a checkpoint after each,
    so theirs may be an iteration apart) and relaunched with the same ``metadata.job``: each
    resumes from its own checkpoint, finds the last launch's generation, joins, and all heal
    from the replica whose checkpoint is the newest (its place: iteration, steps). They finish
    at the one job's weights: nothing is trained twice or skipped."""
    tmp = tmp_path / "relaunch"
    extra = ("elastic.replicas.count=2", "checkpoint.interval=1", "checkpoint.keep=5")
    procs = {n: replica(tmp, etcd, "relaunch", n, None, *extra) for n in "ab"}
    err = {n: tmp_path / f"relaunch-{n}.err" for n in "ab"}
    with reaped(procs) as seen:
        wait_while_running(lambda: all((tmp / f"ckpt/{n}/iter_000002").exists() for n in "ab"), procs, err)
        for n in "ab":
            kill_replica(procs, n, seen)
        saved = {n: sorted(p.name for p in (tmp / f"ckpt/{n}").glob("iter_??????")) for n in "ab"}
        procs |= {n: replica(tmp, etcd, "relaunch", n, None, *extra) for n in "ab"}
        for n in "ab":
            assert procs[n].wait(timeout=600) == 0, err[n].read_text()[-3000:]
    newest = max(int(v[-1][5:]) for v in saved.values())
    assert newest >= 2, saved
    for n in "ab":
        assert f"training from iteration {newest} " in err[n].read_text(), err[n].read_text()[-2000:]
    assert_matches_one_job([model_weights(tmp / f"ckpt/{n}/iter_{ITERS:06d}") for n in "ab"], solo, tiny_model)


@pytest.mark.slow
def test_a_split_commit_heals_the_replica_behind_from_the_one_ahead(tiny_model, tmp_path, etcd, solo):
    """b's commit vote of iteration 2 completes on a, which steps and goes on, and fails on b
    (``split_commit``): nobody is lost. They meet again in the next generation at different
    places (a at iteration 3, b at 2), and b is healed from a, the furthest (torchft's
    max_step), not from member 0, and skips the iteration a committed; a records b's share of
    it in b's ledger. Both end at the one job's weights; without the check, b redoes iteration 2
    while a runs 3 and the two diverge."""
    tmp = tmp_path / "split"
    procs = {
        n: replica(
            tmp,
            etcd,
            "split",
            n,
            {"kind": "split_commit", "iteration": 2} if n == "b" else None,
            "elastic.replicas.count=2",
        )
        for n in "ab"
    }
    err = {n: tmp_path / f"split-{n}.err" for n in "ab"}
    with reaped(procs):
        for n in "ab":
            assert procs[n].wait(timeout=600) == 0, err[n].read_text()[-3000:]
    logs = {n: rows(tmp / f"logs/{n}/metrics.jsonl") for n in "ab"}
    assert [r["iteration"] for r in logs["a"]] == [r["iteration"] for r in logs["b"]] == list(range(ITERS))
    assert [r.get("replica_caught_up", 0) for r in logs["b"]] == [0, 0, 1, 0, 0]
    assert [r["replica_generation"] for r in logs["a"]] == [0, 0, 0, 1, 1]
    assert "the other replicas committed it without this one" in err["b"].read_text()
    assert "redoing iteration 3 with 2 replicas" in err["a"].read_text()
    assert "replica b committed it and did not record it" in err["a"].read_text()
    assert_trained_once_as_one_job(etcd, "split", "ab")  # b's share of iteration 2 recorded by a
    assert_matches_one_job([model_weights(tmp / f"ckpt/{n}/iter_{ITERS:06d}") for n in "ab"], solo, tiny_model)


def signal_replica(proc: subprocess.Popen, sig: int) -> None:
    """``sig`` to a replica's launcher, torchrun agent and ranks: SIGSTOP freezes the node with
    its sockets open, SIGCONT resumes it."""
    for pid in [proc.pid, *(p for p, _ in descendants(proc.pid))]:
        os.kill(pid, sig)


@pytest.mark.slow
def test_a_stopped_replica_resumed_within_an_iteration_catches_up_in_its_process(tiny_model, tmp_path, etcd, solo):
    """c is SIGSTOPped in iteration 1 (its sockets stay open), after it reached the iteration's
    first collective: a and b, inside it, drop c once its lease lapses (``lease_s``, the 5 s users
    get, not gloo's 120 s timeout), agree without c and redo iteration 1
    (held there, ``hold``). c is SIGCONTed: it finds the generation broken and itself left out,
    and asks for the next generation; a and b take it in at iteration 2's start and heal it from
    the member furthest ahead, so c, one iteration behind, takes their state and goes on from
    iteration 2 in the same process, with no restart. All three end at the one job's weights,
    every prompt trained once."""
    tmp, faults = tmp_path / "stopped", tmp_path / "faults"
    faults.mkdir()
    (faults / "hold").write_text("")  # a and b run iteration 0, then wait at each iteration's start
    hold = {"kind": "pause", "dir": str(faults), "points": [], "min_iteration": 0, "world": 1}
    # c, ahead of the held a and b, waits at iteration 1's first arrival when it is stopped: it has
    # arrived, so a and b pass the arrival and wait in the collective itself, for as long as c's
    # lease holds (``Arrivals.wait``)
    procs = {n: replica(tmp, etcd, "stopped", n, hold if n in "ab" else None) for n in "abc"}
    err = {n: tmp_path / f"stopped-{n}.err" for n in "abc"}
    with reaped(procs):
        wait_while_running(lambda: rows(tmp / "logs/c/metrics.jsonl"), procs, err)
        worker = workers(procs["c"])
        signal_replica(procs["c"], signal.SIGSTOP)  # in iteration 1, alone: a and b are held
        (faults / "hold").unlink()
        wait_while_running(lambda: "the surviving replicas redo it" in err["a"].read_text(), {"a": procs["a"]}, err)
        (faults / "hold").write_text("")  # hold the redo until c asked to come back
        wait_while_running(
            lambda: "redoing iteration 1 with 2 replicas" in err["a"].read_text(), {"a": procs["a"]}, err
        )
        signal_replica(procs["c"], signal.SIGCONT)
        wait_while_running(lambda: asked_to_join(etcd, "stopped", "c"), procs, err)
        (faults / "hold").unlink()
        for n in "abc":
            assert procs[n].wait(timeout=600) == 0, err[n].read_text()[-3000:]
    logs = {n: rows(tmp / f"logs/{n}/metrics.jsonl") for n in "abc"}
    assert [r["replicas"] for r in logs["a"]] == [3, 2, 3, 3, 3]
    assert [(r["iteration"], r.get("replica_caught_up", 0)) for r in logs["c"]] == [
        (0, 0),
        (1, 1),
        (2, 0),
        (3, 0),
        (4, 0),
    ]
    assert err["c"].read_text().count("training from iteration") == 1 and len(worker) == 1
    # dropped for its lapsed lease, not gloo's timeout ("Timed out waiting ... for recv")
    assert any("member(s) ['c'] no longer alive" in err[n].read_text() for n in "ab")
    assert_trained_once_as_one_job(etcd, "stopped", "abc")
    assert_matches_one_job([model_weights(tmp / f"ckpt/{n}/iter_{ITERS:06d}") for n in "abc"], solo, tiny_model)


@pytest.mark.slow
def test_a_replica_lost_while_a_joiner_heals_is_left_out_and_the_joiner_heals_again(tiny_model, tmp_path, etcd, solo):
    """c pauses where it would take part in healing e (``heal``) and is SIGKILLed there: the heal
    fails on every member and on e; they agree on the generation after without c and e heals
    again from it, at the same iteration start, with nothing redone."""
    tmp, faults = tmp_path / "healing", tmp_path / "faults"
    faults.mkdir()
    (faults / "hold").write_text("")  # after iteration 0, held at an iteration's start until e asked to join
    hold = {"kind": "pause", "dir": str(faults), "points": [], "min_iteration": 0, "world": 1}
    procs = {n: replica(tmp, etcd, "healing", n, hold | {"points": ["heal"]} if n == "c" else hold) for n in "abc"}
    err = {n: tmp_path / f"healing-{n}.err" for n in "abce"}
    with reaped(procs) as seen:
        wait_while_running(lambda: rows(tmp / "logs/c/metrics.jsonl"), procs, err)
        procs["e"] = replica(tmp, etcd, "healing", "e")
        wait_while_running(lambda: asked_to_join(etcd, "healing", "e"), procs, err)
        (faults / "hold").unlink()
        wait_while_running((faults / "heal.reached").exists, procs, err)
        kill_replica(procs, "c", seen)
        for n in "abe":
            assert procs[n].wait(timeout=600) == 0, err[n].read_text()[-3000:]
    logs = {n: rows(tmp / f"logs/{n}/metrics.jsonl") for n in "abe"}
    joined = logs["e"][0]["iteration"]
    assert 2 <= joined <= 3, joined
    for n in "ab":
        assert [r["iteration"] for r in logs[n]] == list(range(ITERS))
        assert [r["replicas"] for r in logs[n]] == [3] * ITERS  # c's place taken by e at the same boundary
        # generation 1 ({a, b, c, e}) failed while it healed; 2 ({a, b, e}) trained
        assert [r["replica_generation"] for r in logs[n]] == [0] * joined + [2] * (ITERS - joined)
        assert all(r["replica_redone"] == 0 for r in logs[n])
    assert [r["iteration"] for r in logs["e"]] == list(range(joined, ITERS))
    assert_trained_once_as_one_job(etcd, "healing", "abce")
    assert_matches_one_job([model_weights(tmp / f"ckpt/{n}/iter_{ITERS:06d}") for n in "abe"], solo, tiny_model)


@pytest.mark.slow
def test_with_vllm_a_replica_killed_at_its_update_leaves_one_that_redoes_it_alone(tiny_model, tmp_path, etcd, solo):
    """The same with vLLM engines in the replicas (in process, started once): the survivor keeps
    its process and so its engine, redoes the iteration alone, and trains the one job's prompts
    once each. (Its weights are not compared with the HF-engine run's.)"""
    tmp, faults = tmp_path / "vllm", tmp_path / "faults"
    faults.mkdir()
    plan = {"kind": "pause", "dir": str(faults), "points": ["update"], "min_iteration": 1, "world": 1}
    extra = ("elastic.replicas.count=2", "rollout.engine=vllm")
    procs = {n: replica(tmp, etcd, "vllm", n, plan if n == "b" else None, *extra) for n in "ab"}
    err = {n: tmp_path / f"vllm-{n}.err" for n in "ab"}
    with reaped(procs) as seen:
        wait_while_running((faults / "update.reached").exists, procs, err)
        paused = json.loads((faults / "update.reached").read_text())
        worker = workers(procs["a"])
        kill_replica(procs, "b", seen)
        wait_while_running(lambda: "redoing iteration" in err["a"].read_text(), {"a": procs["a"]}, err)
        assert workers(procs["a"]) == worker and len(worker) == 1  # the same process, so the same engine
        assert procs["a"].wait(timeout=600) == 0, err["a"].read_text()[-3000:]
    got = rows(tmp / "logs/a/metrics.jsonl")
    k = paused["iteration"]
    assert [(r["iteration"], r["replicas"]) for r in got] == [(i, 2 if i < k else 1) for i in range(ITERS)]
    text = err["a"].read_text()
    assert text.count("training from iteration") == 1 and f"redoing iteration {k} with 1 replicas" in text
    assert_trained_once_as_one_job(etcd, "vllm", "ab")


@pytest.mark.slow
def test_replicas_of_two_ranks_lose_one_and_match_one_job_of_two(tiny_model, tmp_path, etcd):
    two = ("parallel.nproc_per_node=2", "parallel.train.dp_shard=2", "parallel.gen.dp=2", "trainer.iterations=3")
    # two mini-batches of 4 groups, each shared over a replica's two ranks on its own (``Stage.mini_batched``)
    two += ("data.global_batch_size=8", "actor.mini_batch_size=4")
    one_job(tmp_path / "solo2", etcd, "solo2", *two)
    tmp = tmp_path / "hsdp"
    procs = {n: replica(tmp, etcd, "hsdp", n, None, "elastic.replicas.count=2", *two) for n in "ab"}
    err = {n: tmp_path / f"hsdp-{n}.err" for n in "ab"}
    with reaped(procs) as seen:
        wait_while_running(lambda: rows(tmp / "logs/b/metrics.jsonl"), procs, err)
        kill_replica(procs, "b", seen)  # the launcher, its agent and both ranks
        assert procs["a"].wait(timeout=600) == 0, err["a"].read_text()[-3000:]
    got = rows(tmp / "logs/a/metrics.jsonl")
    assert [(r["iteration"], r["replicas"], r["samples"]) for r in got] == [(0, 2, 8), (1, 1, 16), (2, 1, 16)]
    assert "redoing iteration 1 with 1 replicas" in err["a"].read_text()
    solo = model_weights(tmp_path / "solo2/ckpt/iter_000003")
    # FSDP's reduce-scatter sums in another order over two replicas' ranks: float32 round-off
    assert_matches_one_job([model_weights(tmp / "ckpt/a/iter_000003")], solo, tiny_model, round_off=1e-5)
