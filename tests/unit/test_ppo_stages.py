"""PPO's stages and GRPO's KL-in-reward through the real runner, with a fake dock and fake
engines (as test_stage_fields), against float64 formulas written out here (verl's
compute_value_loss, apply_kl_penalty)."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_stage_fields import B, PROMPTS, FakeDock, _cfg, _run, rows_of, run_named

D = torch.float64
pytestmark = pytest.mark.usefixtures("world_of_one")
LENGTHS = [5, 3, 4, 1, 5, 2]


class FakeCritic:
    """Hands the loss function leaf value tensors and keeps the first step's gradient."""

    def __init__(self, values: torch.Tensor):
        self.values = values.clone().requires_grad_(True)
        self.first = None

    def train_step(self, micro_batches, loss_fn, with_entropy=False, router=None):
        self.values.grad = None
        for k, micro in enumerate(micro_batches):
            loss_fn(self.values[rows_of(micro)], None, k).backward()
        if self.first is None:
            self.first = self.values.grad.clone()
        return {"loss": 0.0, "grad_norm": 0.0, "lr": 1e-3}


def _critic_case(*overrides: str):
    g = torch.Generator().manual_seed(3)
    R = max(LENGTHS)
    mask = torch.arange(R)[None, :] < torch.tensor(LENGTHS)[:, None]
    old = torch.randn(B, R, generator=g, dtype=D) * mask
    new = (old + torch.randn(B, R, generator=g, dtype=D) * 0.8) * mask  # some beyond the clip range
    ret = torch.randn(B, R, generator=g, dtype=D) * mask
    rag = lambda t: [t[k, :n].float() for k, n in enumerate(LENGTHS)]  # noqa: E731
    dock = FakeDock(
        {
            "prompt_ids": PROMPTS,
            "response_ids": [torch.arange(1, n + 1, dtype=torch.int32) for n in LENGTHS],
            "values": rag(old),
            "returns": rag(ret),
        }
    )
    cfg = _cfg("algorithm.name=ppo", *overrides)
    critic = FakeCritic(new.float())
    result = run_named(_run(cfg, dock, None, critic=critic), "critic_update")
    return cfg, critic.first.double(), (new, old, ret, mask.to(D)), result


@pytest.mark.parametrize("clip", ["0.2", "null"])
def test_critic_update_is_the_clipped_value_loss(clip):
    cfg, grad, (new, old, ret, m), result = _critic_case(f"algorithm.value_clip={clip}")
    v = new.float().double().clone().requires_grad_(True)
    old, ret = old.float().double(), ret.float().double()
    loss_t = (v - ret) ** 2
    if cfg.algorithm.value_clip is not None:
        c = cfg.algorithm.value_clip
        loss_t = torch.maximum(loss_t, (torch.clamp(v, old - c, old + c) - ret) ** 2)
    (0.5 * (loss_t * m).sum() / m.sum()).backward()  # token-mean over the one mini-batch
    # float32 critic loss gradient (O(0.1), eps 6e-8) vs float64 formula on the same rounded inputs; measured 1.3e-8
    torch.testing.assert_close(grad, v.grad, atol=1e-6, rtol=1e-6)
    assert result.final["critic_lr"] == 1e-3 and (result.final["value_clip_frac"] > 0) == (clip != "null")


def test_value_clip_changes_the_gradient():
    _, clipped, *_ = _critic_case("algorithm.value_clip=0.2")
    _, free, *_ = _critic_case("algorithm.value_clip=null")
    # clipping moves the gradient by O(0.01-0.1) (measured 0.06), far outside allclose's default
    assert not torch.allclose(clipped, free)


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_grpo_kl_in_reward_shapes_the_sequence_score(estimator):
    g = torch.Generator().manual_seed(5)
    R = max(LENGTHS)
    mask = torch.arange(R)[None, :] < torch.tensor(LENGTHS)[:, None]
    old = -torch.rand(B, R, generator=g, dtype=D) * mask
    ref = (old + (torch.rand(B, R, generator=g, dtype=D) - 0.5)) * mask
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0], dtype=D)
    rag = lambda t: [t[k, :n].float() for k, n in enumerate(LENGTHS)]  # noqa: E731
    dock = FakeDock(
        {
            "reward": [r.float() for r in rewards],
            "old_log_prob": rag(old),
            "ref_log_prob": rag(ref),
            "response_length": [torch.tensor(n, dtype=torch.int32) for n in LENGTHS],
        }
    )
    cfg = _cfg(
        "algorithm.kl_coef=0.3",
        "algorithm.use_kl_loss=false",
        f"algorithm.kl_estimator={estimator}",
        "actor.ppo_epochs=1",
    )
    run_named(_run(cfg, dock, None), "advantage")
    old, ref = old.float().double(), ref.float().double()
    log_r = ref - old
    kl = -log_r if estimator == "k1" else torch.exp(log_r) - 1 - log_r
    score = rewards - 0.3 * (kl * mask).sum(-1)
    s = score.reshape(-1, 3)
    want = ((s - s.mean(1, keepdim=True)) / (s.std(1, keepdim=True) + 1e-6)).reshape(-1)
    # float32 stage output of O(1) advantages vs float64 formula (eps 6e-8 x few ops); measured 4.8e-8
    torch.testing.assert_close(dock.puts["seq_advantage"].double(), want, atol=1e-5, rtol=1e-5)
