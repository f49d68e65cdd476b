"""``reward.rule: math_verify`` with the real math-verify package, and ``reward.format_score``."""

from __future__ import annotations

import json

import pytest

from spmd_rl.dock.etcd_server import EmbeddedEtcd
from spmd_rl.rewards import get_reward
from tests.trainer_util import train


@pytest.mark.parametrize(
    "answer,response,score",
    [
        (r"$\frac{1}{2}$", r"The answer is $0.5$", 1.0),
        (r"$\frac{1}{2}$", r"$\boxed{\dfrac{2}{4}}$", 1.0),
        (r"$\sqrt{4}$", "2", 1.0),
        (r"$x^2+2x+1$", r"$(x+1)^2$", 1.0),
        (r"$\frac{1}{2}$", r"$\frac{1}{3}$", 0.0),
        ("$3$", "$4$", 0.0),
        ("$3$", "no idea", 0.0),
    ],
)
def test_math_verify_equal_forms(answer, response, score):
    assert get_reward("math_verify")(response, answer) == score


def test_format_score_for_well_formed_wrong_answers():
    f = get_reward("exact_match", format_score=0.1)
    assert (f("8", "8"), f("7", "8"), f("seven", "8")) == (1.0, 0.1, 0.0)
    m = get_reward("math_verify", format_score=0.2)
    assert (m("$4$", "$4$"), m("$5$", "$4$"), m("nothing here", "$4$")) == (1.0, 0.2, 0.0)


@pytest.mark.slow
def test_training_with_math_verify_on_latex_answers(tiny_model, tmp_path):
    """The tiny task with every answer written as a LaTeX fraction: the model's plain numbers
    are judged by math-verify, and training runs on those rewards."""
    rows = [json.loads(x) for x in (tiny_model / "train.jsonl").read_text().splitlines()[:400]]
    data = tmp_path / "latex.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": r["prompt"], "answer": f"$\\frac{{{2 * int(r['answer'])}}}{{2}}$"}) + "\n"
            for r in rows
        )
    )
    with EmbeddedEtcd() as etcd:
        out = train(
            tmp_path,
            "mv",
            etcd.endpoint,
            "reward.rule=math_verify",
            f"data.train_path={data}",
            "data.test_path=null",
            "checkpoint.interval=0",
            "trainer.iterations=2",
        )
    assert [r["iteration"] for r in out] == [0, 1]
    assert any(r["accuracy"] > 0 for r in out)  # the warm-started model is right ~25 % of the time
    # means of the same 0/1 values (float32 at worst, 6e-8) vs approx's default rel 1e-6
    assert all(r["reward_mean"] == pytest.approx(r["accuracy"]) for r in out)
    assert all(r["grad_norm"] > 0 for r in out)
