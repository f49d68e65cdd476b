"""Config fields that change the update or the logs must visibly act (an ignored field would
leave the metrics equal to the baseline's). Whether the trainer learns: test_learning_torchrun."""

from __future__ import annotations

import pytest

from tests.trainer_util import train

ONE = ("trainer.iterations=1", "checkpoint.interval=0")
TWO_STEPS = ("actor.mini_batch_size=4",)  # two optimizer steps: the second one is off-policy


@pytest.mark.slow
def test_objective_and_eval_fields_act(tiny_model, tmp_path, etcd):
    base = train(tmp_path, "base", etcd.endpoint, *ONE, *TWO_STEPS, "logging.level=WARNING")[0]
    tis = train(
        tmp_path, "tis", etcd.endpoint, *ONE, *TWO_STEPS, "actor.correction.tis_cap=0.9", "logging.tensorboard=true"
    )[0]
    gspo = train(
        tmp_path,
        "gspo",
        etcd.endpoint,
        *ONE,
        *TWO_STEPS,
        "actor.loss.policy_loss=gspo",
        "trainer.eval_interval=1",
        "trainer.eval_limit=24",
    )[0]
    assert base["reward_mean"] == tis["reward_mean"] == gspo["reward_mean"]  # the same samples
    # logging.level: rank 0's INFO lines ("saved checkpoint ...") only at the default level
    assert "saved checkpoint" not in (tmp_path / "base/stderr.log").read_text()
    assert "saved checkpoint" in (tmp_path / "gspo/stderr.log").read_text()
    assert list((tmp_path / "tis/logs/tb").glob("events.out.tfevents.*")) and not (tmp_path / "base/logs/tb").exists()
    assert "eval_accuracy" not in base and 0 <= gspo["eval_accuracy"] <= 1 and "time_eval" in gspo
    # k/24 in float64 times 24 is k to 1 ulp; approx's default rel 1e-6
    assert gspo["eval_accuracy"] * 24 == pytest.approx(round(gspo["eval_accuracy"] * 24))  # over exactly 24 prompts
    # a cap below 1 lowers every token's weight where exp(old - rollout) > 0.9: a different gradient
    assert abs(tis["grad_norm"] - base["grad_norm"]) > 1e-6 * base["grad_norm"]
    # on-policy GSPO's gradient equals vanilla's (test_policy_loss); after the first step the
    # sequence ratio differs from the token ratios: a different gradient
    assert abs(gspo["grad_norm"] - base["grad_norm"]) > 1e-6 * base["grad_norm"]
