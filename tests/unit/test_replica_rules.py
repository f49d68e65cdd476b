"""Elastic replicas' rules through ``spmd-rl validate`` (``recipe/replica_rules.py``): a config
whose iterations a survivor can redo is valid; each one it cannot redo from its start, or whose
objective is not split-invariant over replicas, exits 2 naming the field and the fix. And the
deal (``elastic.replicas.Replicas``): every replica of a generation takes disjoint units, together
the whole global batch in order, whatever the generation's size."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from spmd_rl.cli import app
from spmd_rl.elastic.replicas import Replicas

BASE = ("data.global_batch_size=8", "actor.mini_batch_size=8", "elastic.replicas.name=a", "elastic.replicas.count=2")


def validate(*overrides: str):
    return CliRunner().invoke(app, ["validate", "configs/quickstart.yaml", *BASE, *overrides])


@pytest.mark.parametrize("extra", [(), ("algorithm.name=rloo",), ("elastic.replicas.count=4",)], ids=str)
def test_a_redoable_config_is_valid(in_repo, tiny_model, extra):
    res = validate(*extra)
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize(
    "overrides,field",
    [
        (("actor.mini_batch_size=4",), "actor.mini_batch_size"),
        (("actor.ppo_epochs=2",), "actor.ppo_epochs"),
        (("algorithm.name=reinforce_pp",), "algorithm.name"),
        (("algorithm.name=ppo", "algorithm.critic_lr=1e-4"), "algorithm.name"),
        (("algorithm.name=dapo", "algorithm.dynamic_sampling=true"), "algorithm.name"),
        (("stream.partial_tokens=4", "actor.tis_cap=2.0"), "stream.partial_tokens"),
        (("elastic.replicas.count=5",), "elastic.replicas.count"),  # 8 groups, units of lcm(2, 2) = 2: 4 shares
        (("elastic.replicas.min_replicas=3",), "elastic.replicas.min_replicas"),
        (("elastic.replicas.name=a/b",), "elastic.replicas.name"),
    ],
    ids=["mini-batch", "epochs", "token-whitening", "critic", "dynamic-sampling", "partial", "too-many", "min", "name"],
)
def test_what_a_survivor_cannot_redo_exits_2_naming_the_field(in_repo, tiny_model, overrides, field):
    res = validate(*overrides)
    assert res.exit_code == 2, res.output
    assert field in res.output, res.output


def fake_group(rank: int, world: int) -> SimpleNamespace:
    return SimpleNamespace(rank=rank, world=world, replica=f"r{rank}")


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_the_deal_covers_the_global_batch_once(world):
    rows = [100 + q for q in range(8)]
    shares = [Replicas(fake_group(r, world), 8, 2).deal(rows) for r in range(world)]
    assert sorted(x for s in shares for x in s) == rows
    for r, share in enumerate(shares):
        assert len(share) == Replicas(fake_group(r, world), 8, 2).share_size()
        assert all(share[k + 1] == share[k] + 1 for k in range(0, len(share), 2))  # whole units of 2 groups


def test_a_replica_left_without_a_unit_is_told_the_fix():
    with pytest.raises(RuntimeError, match="none is left for it; raise data.global_batch_size"):
        Replicas(fake_group(4, 5), 8, 2).deal(list(range(8)))
    with pytest.raises(ValueError, match="dealing 6 rows, not the global batch of 8"):
        Replicas(fake_group(0, 2), 8, 2).deal(list(range(6)))
