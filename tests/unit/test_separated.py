"""Separated placement (AsyncFlow): the layouts of the two sides, the config rules, the
staleness schedule, the weight broadcast (bit for bit, no pickle) and the version ledger."""

from __future__ import annotations

import hashlib
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file

from spmd_rl.config.loader import load_config
from spmd_rl.recipe.rules import check
from spmd_rl.recipe.graph import stages_for
from spmd_rl.engines.vllm import weight_file
from spmd_rl.reshard import broadcast
from spmd_rl.trainer.async_loop import generation_version, published
from spmd_rl.trainer.ledger import StepRecord, problems
from tests.conftest import REPO

SEP = [
    "parallel.placement=separated",
    "parallel.gen_ranks=1",
    "parallel.gen.dp=null",
    "parallel.train.dp_shard=null",
    "actor.correction.tis_cap=2.0",
]


def _check(*overrides: str, world: int = 2):
    return check(load_config(REPO / "configs/quickstart.yaml", [*SEP, *overrides]), world=world)


def test_the_sides_split_the_world(in_repo):
    lay, errors = _check(
        "parallel.gen_ranks=1",
        "data.global_batch_size=6",
        "actor.mini_batch_size=6",
        "actor.micro_batch_size=2",
        world=4,
    )
    assert not errors, errors
    assert (lay.gen.ranks, lay.train.ranks) == (range(0, 1), range(1, 4))
    assert [lay.side_of(r) for r in range(4)] == ["gen", "train", "train", "train"]
    assert [lay.train.coords(r) for r in (1, 2, 3)] == [(0, 0), (1, 0), (2, 0)]
    assert [lay.train.dp_group_leader(g) for g in range(3)] == [1, 2, 3]
    with pytest.raises(ValueError, match="rank 0 is not in this layout"):
        lay.train.coords(0)
    colocated, errors = check(load_config(REPO / "configs/quickstart.yaml", []), world=2)
    assert not errors and not colocated.separated and colocated.side_of(1) == "both"


@pytest.mark.parametrize(
    "overrides, field, problem",
    [
        (["parallel.gen_ranks=null"], "parallel.gen_ranks", "needs the size of the generation side"),
        (["parallel.gen_ranks=2"], "parallel.gen_ranks", "leaves no rank to train"),
        (["parallel.placement=colocated"], "parallel.gen_ranks", "only used by parallel.placement: separated"),
        (["parallel.train.dp_shard=2"], "parallel.train.dp_shard", "!= training side's rank count 1"),
        (["actor.correction.tis_cap=null"], "parallel.placement", "must be corrected"),
        (["stream.fuse=true"], "parallel.placement", "stream.fuse"),
        (["stream.partial_tokens=2"], "parallel.placement", "stream.partial_tokens"),
        (
            ["algorithm.name=dapo", "algorithm.dynamic_sampling=true"],
            "parallel.placement",
            "algorithm.dynamic_sampling",
        ),
    ],
)
def test_separated_config_is_checked(in_repo, overrides, field, problem):
    _, errors = _check(*overrides)
    assert any(e.field == field and problem in e.problem for e in errors), errors


def test_one_engine_per_generator(in_repo):
    _, errors = _check("parallel.gen_ranks=2", "parallel.gen.tp=2", world=4)
    assert [e.field for e in errors] == ["parallel.gen.tp"], errors


def test_the_rollout_tags_versions_the_update_reads(in_repo):
    graph = stages_for(load_config(REPO / "configs/quickstart.yaml", SEP))
    assert "response_version" in graph[0].outputs and "response_version" in graph[-1].inputs


@pytest.mark.parametrize("final", [False, True], ids=["no-eval", "final-eval"])
@pytest.mark.parametrize("start, iterations, k", [(0, 6, 1), (0, 6, 2), (3, 9, 1), (0, 3, 5), (2, 3, 1)])
def test_every_broadcast_has_its_receiver_and_the_lag_is_bounded(in_repo, start, iterations, k, final):
    """The generator's loop against the trainer's published versions (both as in
    ``trainer.async_loop``, with k = stream.max_policy_lag): it receives exactly those, in
    order, and iteration i is trained (update i) at most k updates after the policy that
    generated it. With the final eval (``eval.interval``) its one receive after the
    loop is the final policy, version ``iterations``."""
    k = load_config(REPO / "configs/quickstart.yaml", [*SEP, f"stream.max_policy_lag={k}"]).stream.max_policy_lag
    sent = published(start, iterations, k, final)
    holds, received = start, []
    for it in range(start, iterations):
        while holds < generation_version(it, start, k):
            holds = sent[len(received)]  # the next broadcast
            received.append(holds)
        assert holds == generation_version(it, start, k) and 0 <= it - holds <= k
        assert all(v <= it for v in received)  # version v is published after update v - 1 < it
    if final:
        received.append(sent[len(received)])  # the generators' receive after their loop
        assert received[-1] == iterations
    assert received == sent


_g = torch.Generator().manual_seed(0)  # the same values in every spawned process
WEIGHTS = {
    "a.weight": torch.randn(7, 5, generator=_g),
    "b.bias": torch.randn(3, generator=_g).to(torch.bfloat16),
    "scale": torch.tensor(2.5),
    "big": torch.randn(40, 10, generator=_g),
    "c.weight": torch.randn(2, 2, dtype=torch.float64, generator=_g),
}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _peer(rank: int, init: str, limit: int, folder: str, q) -> None:
    """Rank 0 sends WEIGHTS; rank 1 streams them into a weight file (what a generator does),
    noting how many broadcasts it had received when each tensor was yielded."""
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    cpu = torch.device("cpu")
    if rank == 0:
        meta = [(n, t.dtype, list(t.shape)) for n, t in WEIGHTS.items()]
        q.put(("sent", broadcast.send(7, meta, iter(WEIGHTS.items()), limit, 0, None, cpu, True)))
    else:
        calls, real = [], dist.broadcast
        dist.broadcast = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
        version, meta, stream = broadcast.receive(limit, 0, None, cpu)
        h, seen = hashlib.sha256(), []

        def tap():
            for name, t in broadcast.hashed(stream, h):
                seen.append(len(calls))
                yield name, t

        path = os.path.join(folder, "w.safetensors")
        assert weight_file.write(path, meta, tap()) == len(WEIGHTS)
        got = load_file(path)
        same = [n for n, t in got.items() if torch.equal(_bits(t), _bits(WEIGHTS[n]))]
        q.put(("received", version, list(got), [t.dtype for t in got.values()], same, h.hexdigest(), seen))
    dist.destroy_process_group()


@pytest.mark.parametrize("limit", [64, 1 << 20])
def test_broadcast_streams_the_weights_bit_for_bit(limit, tmp_path):
    """Two processes, gloo: small buckets (every tensor alone but 'b.bias' + 'scale', 'big' above
    the limit) and one bucket. The weight file read back equals what was sent, and each bucket's
    tensors are yielded before the next bucket is received (2 header broadcasts, then one per bucket)."""
    ctx, init = mp.get_context("spawn"), f"file://{tmp_path / 'store'}"  # a file store: no port to race for
    q = ctx.Queue()
    procs = [ctx.Process(target=_peer, args=(r, init, limit, str(tmp_path), q)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = dict((m[0], m[1:]) for m in (q.get(timeout=120), q.get(timeout=120)))
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    version, names, dtypes, same, digest, seen = got["received"]
    assert version == 7 and sorted(names) == sorted(WEIGHTS) and dtypes == [WEIGHTS[n].dtype for n in names]
    assert sorted(same) == sorted(WEIGHTS) and digest == got["sent"][0] == broadcast.digest(WEIGHTS.values())
    assert seen == ([3, 4, 4, 5, 6] if limit == 64 else [3] * 5)


def test_the_weight_file_matches_safetensors_and_refuses_a_mismatch(tmp_path):
    path = str(tmp_path / "w.safetensors")
    meta = [(n, t.dtype, list(t.shape)) for n, t in WEIGHTS.items()]
    weight_file.write(path, meta, iter(WEIGHTS.items()))
    got = load_file(path)
    assert all(torch.equal(_bits(got[n]), _bits(t)) and got[n].shape == t.shape for n, t in WEIGHTS.items())
    with pytest.raises(ValueError, match="weight 1 is b.bias torch.float32 .*announced b.bias torch.bfloat16"):
        weight_file.write(path, meta, iter([("a.weight", WEIGHTS["a.weight"]), ("b.bias", WEIGHTS["b.bias"].float())]))
    with pytest.raises(ValueError, match="weight x: dtype torch.int64"):
        weight_file.header([("x", torch.int64, [2])])


def test_buckets_close_before_the_limit():
    assert broadcast.buckets([10, 10, 10, 50, 5], 25) == [range(0, 2), range(2, 3), range(3, 4), range(4, 5)]
    assert broadcast.buckets([], 8) == [] and broadcast.buckets([9], 8) == [range(0, 1)]


def test_the_ledger_flags_a_decreasing_policy_version():
    ok = [StepRecord(0, [1], [1], version=0), StepRecord(1, [2], [2], version=0), StepRecord(2, [3], [3], version=1)]
    assert problems(ok) == []
    bad = ok + [StepRecord(3, [4], [4], version=0)]
    assert any("versions must not decrease" in p for p in problems(bad))
