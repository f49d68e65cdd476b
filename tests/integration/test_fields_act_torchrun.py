"""Config fields that change the update or the logs must visibly act (an ignored field would
leave the metrics equal to the baseline's). Whether the trainer learns: test_learning_torchrun."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.trainer_util import train

REPO = Path(__file__).resolve().parents[2]

ONE = ("trainer.iterations=1", "checkpoint.interval=0")
TWO_STEPS = ("actor.mini_batch_size=4",)  # two optimizer steps: the second one is off-policy


@pytest.mark.slow
def test_objective_and_eval_fields_act(tiny_model, tmp_path, etcd):
    base = train(tmp_path, "base", etcd.endpoint, *ONE, *TWO_STEPS, "logging.level=WARNING")[0]
    tis = train(
        tmp_path, "tis", etcd.endpoint, *ONE, *TWO_STEPS, "actor.correction.tis_cap=0.9", "logging.tensorboard=true"
    )[0]
    tagged = tmp_path / "tagged.jsonl"  # the test prompts, each tagged with one of two data sources
    rows = [json.loads(line) for line in (REPO / "assets/tiny-qwen2/test.jsonl").read_text().splitlines()]
    tagged.write_text("".join(json.dumps(r | {"data_source": f"src{k % 2}"}) + "\n" for k, r in enumerate(rows)))
    gspo = train(
        tmp_path,
        "gspo",
        etcd.endpoint,
        *ONE,
        *TWO_STEPS,
        "actor.loss.policy_loss=gspo",
        "eval.interval=1",
        "eval.limit=24",
        f"data.test_path.plain={REPO / 'assets/tiny-qwen2/test.jsonl'}",
        f"data.test_path.tagged={tagged}",
        "eval.n=4",
    )[0]
    assert base["reward_mean"] == tis["reward_mean"] == gspo["reward_mean"]  # the same samples
    # logging.level: rank 0's INFO lines ("saved checkpoint ...") only at the default level
    assert "saved checkpoint" not in (tmp_path / "base/stderr.log").read_text()
    assert "saved checkpoint" in (tmp_path / "gspo/stderr.log").read_text()
    assert list((tmp_path / "tis/logs/tb").glob("events.out.tfevents.*")) and not (tmp_path / "base/logs/tb").exists()
    assert "eval_accuracy" not in base and 0 <= gspo["eval_accuracy"] <= 1 and "time_eval" in gspo
    # k/24 in float64 times 24 is k to 1 ulp; approx's default rel 1e-6
    assert gspo["eval_accuracy"] * 24 == pytest.approx(round(gspo["eval_accuracy"] * 24))  # over exactly 24 prompts
    _check_sampled_eval(gspo, tmp_path / "gspo/logs/eval_prompts.jsonl")
    # a cap below 1 lowers every token's weight where exp(old - rollout) > 0.9: a different gradient
    assert abs(tis["grad_norm"] - base["grad_norm"]) > 1e-6 * base["grad_norm"]
    # on-policy GSPO's gradient equals vanilla's (test_policy_loss); after the first step the
    # sequence ratio differs from the token ratios: a different gradient
    assert abs(gspo["grad_norm"] - base["grad_norm"]) > 1e-6 * base["grad_norm"]


def _check_sampled_eval(row: dict, record: Path) -> None:
    """eval.n: the logged pass@k of each set and source equal the unbiased estimator's formula
    (math.comb) over the per-prompt counts the run recorded; both sets hold the same prompts,
    so the same greedy answers; the final policy is evaluated too."""
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert [(x["iteration"], x["set"]) for x in lines] == [(0, "plain"), (0, "tagged"), (1, "plain"), (1, "tagged")]
    assert lines[0]["correct"] == lines[1]["correct"] and row["eval_accuracy"] == row["eval/plain/greedy"]
    counts = lines[1]["sampled_right"]
    assert len(counts) == 24 and all(0 <= c <= 4 for c in counts)
    for source, picked in (("", counts), ("src0/", counts[0::2]), ("src1/", counts[1::2])):
        for k in (1, 2, 4):
            formula = sum(1 - math.comb(4 - c, k) / math.comb(4, k) for c in picked) / len(picked)
            # float64 means of <= 24 terms, each a product of <= 4 factors: 1e-12
            assert row[f"eval/tagged/{source}pass@{k}"] == pytest.approx(formula, abs=1e-12)
        assert row[f"eval/tagged/{source}mean@4"] == pytest.approx(sum(picked) / (4 * len(picked)), abs=1e-12)
        assert 0 <= row[f"eval/tagged/{source}maj@4"] <= 1
    assert "eval/plain/src0/greedy" not in row  # a set without sources is not split
    assert {"final_eval_accuracy", "final_eval/tagged/pass@4", "final_eval/tagged/src1/maj@4"} <= set(row)
