"""PPO's critic learns, under real torchrun on the quickstart task (2 ranks, FSDP layout): with the
policy held still (a vanishing actor learning rate) on 16 fixed prompts, the critic's targets
are stationary: from a random value head its value loss falls and the share of the returns'
variance it explains turns positive.

That PPO as a whole learns (policy and critic together) is ``test_learning_torchrun.py``'s
``separated-ppo`` mode, judged as every mode is on the prompts it trains on.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForTokenClassification

from tests.trainer_util import train

QUICKSTART = (
    "data.global_batch_size=16",
    "rollout.n=8",
    "actor.mini_batch_size=16",
    "actor.micro_batch_size=32",
    "checkpoint.interval=0",
)
PPO = ("algorithm.name=ppo", "algorithm.critic_lr=1e-4")


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


@pytest.mark.slow
def test_critic_value_loss_falls_under_a_fixed_policy(tiny_model, tmp_path, etcd):
    """From a critic folder with a random value head (values far from the returns), under a
    still policy on 16 fixed prompts (stationary targets)."""
    few = tmp_path / "train16.jsonl"
    few.write_text("".join((tiny_model / "train.jsonl").read_text().splitlines(keepends=True)[:16]))
    torch.manual_seed(0)
    AutoModelForTokenClassification.from_pretrained(tiny_model, num_labels=1).save_pretrained(tmp_path / "critic")
    rows = train(
        tmp_path,
        "critic",
        etcd.endpoint,
        *QUICKSTART,
        *PPO,
        "actor.optim.lr=1e-12",
        "algorithm.critic_lr=1e-3",
        "trainer.iterations=30",
        f"data.train_path={few}",
        f"critic.model_path={tmp_path / 'critic'}",
    )
    loss = [r["value_loss"] for r in rows]
    print("value_loss per iteration:", [round(x, 4) for x in loss])
    print("value_explained_var per iteration:", [round(r["value_explained_var"], 3) for r in rows])
    explained = [r["value_explained_var"] for r in rows]
    assert _mean(loss[-5:]) < 0.75 * _mean(loss[:5])
    assert _mean(explained[-10:]) > 0 > _mean(explained[:5])
