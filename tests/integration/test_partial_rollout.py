"""Partial rollout (``stream.partial_tokens``): responses continued across iterations.

- The engine's primitive (real vLLM): with a budget below the longest response, greedy
  responses continued in pieces equal the ones generated at once, token for token, with the
  same log-probs and the same stop.
- The trainer (real torchrun, etcd, vLLM): every prompt group drawn is trained once or still
  carried, whole groups, an even count over the 2 DP ranks; continued tokens of older policies
  are trained (lag >= 1); a checkpoint records the carried rows and a resumed run keeps the
  balance.
"""

from __future__ import annotations

import json

import pytest
import torch

from spmd_rl.config.loader import load_config
from spmd_rl.recipe.rules import check
from spmd_rl.recipe.graph import PARTIAL_COLUMNS, stages_for
from spmd_rl.dock.columns import specs_of
from spmd_rl.recipe.columns import column_decls
from spmd_rl.dock.metadata import MetadataStore
from spmd_rl.engines.base import Sample
from spmd_rl.trainer.carry import CarriedGroup, Piece
from spmd_rl.trainer.ledger import PromptLedger, problems
from tests.conftest import REPO, run_helper
from tests.torchrun_util import OwnShm
from tests.trainer_util import G, N, train


@pytest.mark.slow
def test_greedy_responses_continued_in_pieces_equal_one_generation(tiny_model):
    budget, limit = 1, 8
    got = run_helper("partial_continuation.py", tiny_model, budget, limit)
    assert max(len(w["ids"]) for w in got["whole"]) > budget  # the budget cuts at least one response
    assert max(p["pieces"] for p in got["pieces"]) >= 2
    for whole, pieces in zip(got["whole"], got["pieces"]):
        assert pieces["ids"] == whole["ids"] and pieces["stopped"] == whole["stopped"]
        # float32: a continuation re-prefills its context (other shapes than one decode) ~1e-6-1e-5; 1e-4
        assert max((abs(a - b) for a, b in zip(pieces["logprobs"], whole["logprobs"])), default=0.0) < 1e-4


@pytest.mark.slow
def test_the_rollout_stage_continues_a_carried_response_with_its_versions(tiny_model):
    """The stage function itself, iteration 0 then 1 without a weight update, temperature 0."""
    budget, limit = 2, 8
    got = run_helper("partial_stage.py", tiny_model, budget, limit)
    assert max(len(w) for w in got["whole"]) > budget and all(len(a) <= budget for a in got["after_0"])
    assert got["carried"] == got["whole"] and all(got["done"])
    for ids, versions, lps in zip(got["carried"], got["versions"], got["logprobs"]):
        assert versions == [0] * min(budget, len(ids)) + [1] * max(0, len(ids) - budget)  # who generated each token
        assert len(lps) == len(ids)


@pytest.mark.slow
def test_partial_rollout_trains_every_group_once_and_resumes(tiny_model, tmp_path, etcd):
    """Real torchrun, 2 ranks: responses of about 3-4 tokens with a budget of 2 per iteration."""
    args = (
        "stream.partial_tokens=2",
        "actor.correction.tis_cap=2.0",
        "trainer.iterations=4",
        "rollout.temperature=1.0",
    )
    rows = train(tmp_path, "partial", etcd.endpoint, *args)
    assert [r["iteration"] for r in rows] == [0, 1, 2, 3]
    ledger = PromptLedger(MetadataStore([etcd.endpoint], job="t-partial.ledger")).read()
    assert problems(ledger) == []  # nothing lost, nothing trained twice: from what was sampled, put and read
    observed(rows, ledger)
    assert rows[0]["partial_new_groups"] == G and rows[0]["partial_carried_groups"] > 0  # the budget cut responses
    for r in rows:
        assert (
            r["samples"] == r["partial_trained_groups"] * N and r["partial_trained_groups"] % 2 == 0
        )  # whole groups, even over 2 DP ranks
        assert r["partial_new_groups"] + r["partial_carried_groups"] <= G + rows[0]["partial_carried_groups"]
        if r["samples"]:
            assert 0 <= r["policy_lag_mean"] <= r["policy_lag_max"] <= r["iteration"]
    assert max(r.get("policy_lag_max", 0) for r in rows) >= 1  # continued tokens of an older policy were trained
    ckpt = tmp_path / "partial/ckpt/iter_000002"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert len(state["carry_rows"]) == rows[1]["partial_carried_groups"]
    resumed = train(tmp_path, "partial-resumed", etcd.endpoint, *args, f"checkpoint.resume={ckpt}")
    assert [r["iteration"] for r in resumed] == [2, 3]
    again = PromptLedger(MetadataStore([etcd.endpoint], job="t-partial-resumed.ledger")).read()
    assert problems(again, start_carried=state["carry_rows"]) == []  # the restored carry is trained or carried on
    observed(resumed, again)


def observed(rows: list[dict], ledger: list) -> None:
    """The partial-rollout metrics count what the ledger observed: the prompts the sampler
    handed out, the rows the update read, the rows still carried (``trainer.ledger``)."""
    ledger = sorted(ledger, key=lambda r: r.iteration)
    assert [len(r.sampled) for r in ledger] == [r["partial_new_groups"] for r in rows]
    assert [len(r.trained) for r in ledger] == [r["partial_trained_groups"] for r in rows]
    assert [r.trained_samples for r in ledger] == [r["samples"] for r in rows]
    assert [len(r.carried) for r in ledger] == [r["partial_carried_groups"] for r in rows]


@pytest.mark.parametrize(
    "overrides, problem",
    [
        (["stream.partial_tokens=8"], "not below rollout.max_response_length=8"),
        (["actor.correction.tis_cap=null"], "must correct"),
        (["actor.mini_batch_size=8"], "mini-batches of a fixed size"),
        (["algorithm.name=ppo"], "not supported with ppo"),
        (["algorithm.name=dapo", "algorithm.dynamic_sampling=true"], "not supported with dapo dynamic sampling"),
        (["stream.fuse=true"], "stage fusion needs"),
    ],
)
def test_partial_rollout_config_is_checked(in_repo, overrides, problem):
    cfg = load_config(
        REPO / "configs/quickstart.yaml", ["stream.partial_tokens=4", "actor.correction.tis_cap=2.0", *overrides]
    )
    _, errors = check(cfg, world=2)
    assert [e.field for e in errors] == ["stream.partial_tokens"] and problem in errors[0].problem, errors


def test_partial_rollout_graph_reads_the_prefix_and_versions():
    cfg = load_config(REPO / "configs/quickstart.yaml", ["stream.partial_tokens=4", "actor.correction.tis_cap=2.0"])
    graph = stages_for(cfg)
    assert set(PARTIAL_COLUMNS) <= set(graph[0].inputs) and "response_version" in graph[0].outputs
    assert "response_version" in graph[-1].inputs  # the update logs each token's policy lag
    specs = specs_of(column_decls(graph))
    assert {c: specs[c].writer for c in PARTIAL_COLUMNS} == dict.fromkeys(PARTIAL_COLUMNS, "data")
    assert (
        specs["prefix_ids"].ragged
        and not specs["prefix_done"].ragged
        and specs["response_version"].dtype == torch.int32
    )
    plain = stages_for(load_config(REPO / "configs/quickstart.yaml"))
    assert not set(PARTIAL_COLUMNS) & set(specs_of(column_decls(plain)))


def test_a_piece_finishes_on_a_stop_or_at_the_limit():
    p = Piece(7)
    p.extend(Sample([4, 5], [-0.1, -0.2]), version=0, limit=6)
    assert (p.token_ids, p.versions, p.done) == ([4, 5], [0, 0], False)
    p.extend(Sample([6], [-0.3], stopped=True), version=1, limit=6)
    assert (p.token_ids, p.logprobs, p.versions, p.done) == ([4, 5, 6], [-0.1, -0.2, -0.3], [0, 0, 1], True)
    q = Piece(7, [1, 2, 3, 4], [0.0] * 4, [0] * 4)
    q.extend(Sample([9, 9], [-1.0, -1.0]), version=2, limit=6)
    assert q.done and q.versions == [0, 0, 0, 0, 2, 2]
    cols = q.columns()
    assert cols["prefix_ids"].dtype == torch.int32 and cols["prefix_done"].item() == 1
    assert CarriedGroup.fresh(3, 4).pieces == [Piece(3)] * 4 and not CarriedGroup.fresh(3, 4).done


@pytest.mark.slow
def test_partial_rollout_with_tensor_parallel_generation(tiny_model, tmp_path, etcd):
    """Generation TP 2 (one generation DP group of both ranks): both TP ranks carry the same
    groups, only TP rank 0 puts them, and the balance holds."""
    with OwnShm(period_s=0.2) as shm:
        rows = train(
            tmp_path,
            "partial-tp",
            etcd.endpoint,
            "stream.partial_tokens=2",
            "actor.correction.tis_cap=2.0",
            "trainer.iterations=3",
            "parallel.gen.dp=1",
            "parallel.gen.tp=2",
        )
    assert rows[0]["partial_carried_groups"] > 0 and sum(r["samples"] for r in rows) > 0
    ledger = PromptLedger(MetadataStore([etcd.endpoint], job="t-partial-tp.ledger")).read()
    assert set(ledger[0].carried) <= set(ledger[0].sampled)  # iteration 0 carries only what it sampled
    assert problems(ledger) == []
    observed(rows, ledger)
    # vLLM's CPU TP segments lost their names once mapped, so the next run can create them again
    assert not shm.named_cpushm()
