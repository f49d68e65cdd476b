"""Elastic replicas' rules through ``spmd-rl validate`` (``recipe/replica_rules.py``): a config
whose iterations a survivor can redo is valid; each one it cannot redo from its start, or whose
objective is not split-invariant over replicas, exits 2 naming the field and the fix. And the
deal (``elastic.replicas.Replicas``): every replica of a generation takes disjoint units, together
the whole global batch in order, whatever the generation's size, each replica's mini-batches
holding its part of the global mini-batches."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from spmd_rl.cli import app
from spmd_rl.elastic.replicas import Replicas

BASE = ("data.global_batch_size=8", "actor.mini_batch_size=8", "elastic.replicas.name=a", "elastic.replicas.count=2")


def validate(*overrides: str):
    return CliRunner().invoke(app, ["validate", "configs/quickstart.yaml", *BASE, *overrides])


@pytest.mark.parametrize(
    "extra",
    [
        (),
        ("algorithm.name=rloo",),
        ("algorithm.name=reinforce_pp",),  # whitened over the replicas' batch
        ("algorithm.name=ppo", "algorithm.critic_lr=1e-4"),  # a critic: its gradients summed, its state kept
        ("elastic.replicas.count=4",),
        (
            "actor.mini_batch_size=4",
            "actor.micro_batch_size=8",
            "actor.ppo_epochs=2",
        ),  # several steps: the iteration's start is kept
    ],
    ids=str,
)
def test_a_redoable_config_is_valid(in_repo, tiny_model, extra):
    res = validate(*extra)
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize(
    "overrides,field",
    [
        (("actor.mini_batch_size=2",), "elastic.replicas.count"),  # 1 unit of lcm(2, 2) = 2 groups per mini-batch
        (("actor.mini_batch_size=1", "elastic.replicas.count=1"), "use a multiple of 2"),  # half a unit
        (("algorithm.name=dpo",), "a preference objective"),
        (("algorithm.name=dapo", "algorithm.dynamic_sampling=true"), "algorithm.name"),
        (("stream.partial_tokens=4", "actor.correction.tis_cap=2.0"), "stream.partial_tokens"),
        (("elastic.replicas.count=5",), "elastic.replicas.count"),  # 8 groups, units of lcm(2, 2) = 2: 4 shares
        (("elastic.replicas.min_replicas=3",), "elastic.replicas.min_replicas"),
        (("elastic.replicas.name=a/b",), "elastic.replicas.name"),
        (("metadata.endpoints=[10.0.0.1:2379]",), "other hosts cannot reach on loopback"),
        (("dock.interface=10.0.0.2",), "authenticate no peer"),
    ],
    ids=[
        "unit-per-replica",
        "half-unit",
        "dpo",
        "dynamic-sampling",
        "partial",
        "too-many",
        "min",
        "name",
        "loopback-store-remote-etcd",
        "off-loopback-without-tls",
    ],
)
def test_what_a_survivor_cannot_redo_exits_2_naming_the_field(in_repo, tiny_model, overrides, field):
    res = validate(*overrides)
    assert res.exit_code == 2, res.output
    assert field in res.output, res.output


def fake_group(rank: int, world: int) -> SimpleNamespace:
    members = tuple(f"r{r}" for r in range(world))
    return SimpleNamespace(
        rank=rank, world=world, replica=members[rank], gen=SimpleNamespace(members=members, number=0)
    )


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_the_deal_covers_the_global_batch_once(world):
    rows = [100 + q for q in range(8)]
    shares = [Replicas(fake_group(r, world), 8, 8, 2).deal(rows) for r in range(world)]
    assert sorted(x for s in shares for x in s) == rows
    for r, share in enumerate(shares):
        assert len(share) == Replicas(fake_group(r, world), 8, 8, 2).share_size()
        assert all(share[k + 1] == share[k] + 1 for k in range(0, len(share), 2))  # whole units of 2 groups


@pytest.mark.parametrize("world", [1, 2, 3])
def test_each_replica_mini_batch_is_its_part_of_the_global_one(world):
    """12 groups in mini-batches of 6, units of 2: replica r's mini-batch m (its share cut into
    mini-batches of ``share_mini_batch``) holds only rows of the global mini-batch m, and the
    replicas' mini-batches m together are all of it."""
    rows = [100 + q for q in range(12)]
    reps = [Replicas(fake_group(r, world), 12, 6, 2) for r in range(world)]
    for m in range(2):
        parts = []
        for rep in reps:
            size = rep.share_mini_batch()
            assert rep.share_size() == 2 * size
            parts += rep.deal(rows)[m * size : (m + 1) * size]
        assert sorted(parts) == rows[m * 6 : (m + 1) * 6]


def test_a_replica_left_without_a_unit_is_told_the_fix():
    with pytest.raises(RuntimeError, match="none is left for it; raise actor.mini_batch_size"):
        Replicas(fake_group(4, 5), 8, 8, 2).deal(list(range(8)))
    with pytest.raises(ValueError, match="dealing 6 rows, not the global batch of 8"):
        Replicas(fake_group(0, 2), 8, 8, 2).deal(list(range(6)))


def redo_deal(before: list[str], members: tuple[str, ...], number: int = 4, differed: bool = False):
    gen = SimpleNamespace(members=members, number=number)
    group = SimpleNamespace(gen=gen, places_differed=differed, replica=members[0], rank=0, world=len(members))
    return Replicas(group, 12, 6, 1)._sticky(before, 3)


def test_the_redo_keeps_each_survivors_groups_and_deals_the_lost_ones():
    """After c's loss each survivor keeps its unit places (the groups it already generated are
    its share again: ``FinishedGroups``); c's places go round-robin over the survivors."""
    assert redo_deal(list("abcabc"), ("a", "b")) == list("abaabb")
    assert redo_deal(list("abcabc"), ("b", "a")) == list("abbaba")  # the generation's order deals the lost


@pytest.mark.parametrize(
    "members,number,differed",
    [(("a", "b", "d"), 4, False), (("a", "b"), 5, False), (("a", "b"), 4, True)],
    ids=["a-joiner", "a-generation-between", "split-commit"],
)
def test_the_redo_is_the_round_robin_where_a_member_did_not_know_the_failed_deal(members, number, differed):
    """A member new to it, a generation in between (a member left out rejoins), or a split
    commit (the members were in different attempts): they could compute different deals."""
    assert redo_deal(list("abcabc"), members, number, differed) is None
