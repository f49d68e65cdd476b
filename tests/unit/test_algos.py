"""Pure algorithm functions against hand computations in float64."""

from __future__ import annotations

import math

import pytest
import torch

from spmd_rl.algos.core import gae, grpo_advantages, kl_estimate, overlong_penalty
from spmd_rl.algos.dynamic_sampling import signal_groups
from spmd_rl.algos.policy_loss import ClipConfig, LossNorm, aggregate, vanilla_ppo


def policy_loss(logp, old, adv, mask, low, high, c, mode):
    out = vanilla_ppo(logp, old, adv, mask, ClipConfig(low, high, c, mode))
    return out.loss, torch.tensor(out.clipped_tokens / float(mask.sum()))


D = torch.float64


def test_grpo_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0], dtype=D)
    a = grpo_advantages(r, 4, norm_by_std=True, eps=0.0)
    std = math.sqrt(((0.5**2) * 4) / 3)  # unbiased std of [1,0,0,1]
    # float64 vs the same hand formula: a few roundings of eps 2.2e-16 against allclose's default rtol 1e-5
    assert torch.allclose(a[:4], torch.tensor([0.5, -0.5, -0.5, 0.5], dtype=D) / std)
    assert torch.equal(grpo_advantages(r, 4, norm_by_std=False)[4:], torch.zeros(4, dtype=D))
    assert torch.equal(grpo_advantages(r, 4, norm_by_std=False)[:4], torch.tensor([0.5, -0.5, -0.5, 0.5], dtype=D))
    assert signal_groups(r, 4).tolist() == [True, False]


def test_kl_estimators_by_hand():
    logp = torch.tensor([-1.0, -2.0], dtype=D)
    ref = torch.tensor([-1.5, -1.0], dtype=D)
    log_r = ref - logp  # [-0.5, 1.0]
    # float64, the estimators' own formulas (this and the next 2 lines): equal to 1 ulp (2.2e-16); allclose default
    assert torch.allclose(kl_estimate(logp, ref, "k1"), -log_r)
    assert torch.allclose(kl_estimate(logp, ref, "k2"), 0.5 * log_r**2)
    assert torch.allclose(kl_estimate(logp, ref, "k3"), torch.exp(log_r) - 1 - log_r)
    assert (kl_estimate(logp, ref, "k3") >= 0).all()


def test_aggregation_modes_by_hand():
    v = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]], dtype=D)
    m = torch.tensor([[1, 1, 1], [1, 0, 0]])
    # exact in float64 (this and the next 3 lines): small integers over 4, 8 or 2; approx's default rel 1e-6
    assert aggregate(v, m, "token-mean").item() == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert aggregate(v, m, "token-mean", LossNorm(tokens=8.0, seqs=2.0)).item() == pytest.approx(10 / 8)
    assert aggregate(v, m, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert aggregate(v, m, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)


def test_policy_loss_clip_and_dual_clip_by_hand():
    old = torch.zeros(1, 4, dtype=D)
    ratio = torch.tensor([[0.5, 1.0, 1.5, 5.0]], dtype=D)
    logp = ratio.log()
    m = torch.ones(1, 4)
    # A > 0: loss = max(-A r, -A clip(r, 0.8, 1.3)) -> -A * min(r, 1.3) for r > 1.3, -A * max... elementwise:
    adv = torch.ones(1, 4, dtype=D)
    loss, frac = policy_loss(logp, old, adv, m, 0.2, 0.3, None, "token-mean")
    expect = [max(-r, -min(max(r, 0.8), 1.3)) for r in [0.5, 1.0, 1.5, 5.0]]
    # float64: exp(log r) returns r within ~2 ulp (4.4e-16), far inside approx's default rel 1e-6
    assert loss.item() == pytest.approx(sum(expect) / 4)
    assert frac.item() == pytest.approx(2 / 4)  # r = 1.5 and 5.0 clipped at 1.3
    # A < 0 with dual clip c = 3: loss = min(max(-A r, -A clip), -A c)
    adv = -torch.ones(1, 4, dtype=D)
    loss, _ = policy_loss(logp, old, adv, m, 0.2, 0.3, 3.0, "token-mean")
    expect = [min(max(r, min(max(r, 0.8), 1.3)), 3.0) for r in [0.5, 1.0, 1.5, 5.0]]
    # float64: exp(log r) returns r within ~2 ulp; approx's default rel 1e-6
    assert loss.item() == pytest.approx(sum(expect) / 4)


def test_on_policy_gradient_is_minus_advantage():
    logp = torch.tensor([[-0.7, -1.2]], dtype=D, requires_grad=True)
    adv = torch.tensor([[2.0, -1.0]], dtype=D)
    loss, _ = policy_loss(logp, logp.detach(), adv, torch.ones(1, 2), 0.2, 0.2, 3.0, "token-mean")
    loss.backward()
    # float64: the on-policy ratio is exp(0) = 1 exactly, so the gradient is -A/2 to 1 ulp; allclose default
    assert torch.allclose(logp.grad, -adv / 2)


def test_overlong_penalty_by_hand():
    L = torch.tensor([10, 12, 14, 16])
    # exact: float32 (L - 12) / 4 clamped gives 0, 0.5 and 1 exactly; approx's default (abs 1e-12 at 0)
    assert overlong_penalty(L, 16, 4, 1.0).tolist() == pytest.approx([0.0, 0.0, -0.5, -1.0])
    assert overlong_penalty(L, 16, 0, 1.0).tolist() == [0.0] * 4


def test_gae_by_hand():
    r = torch.tensor([[0.0, 0.0, 1.0]], dtype=D)
    v = torch.tensor([[0.5, 0.6, 0.7]], dtype=D)
    m = torch.ones(1, 3)
    g, lam = 0.9, 0.8
    d2 = 1.0 - 0.7
    d1 = 0.0 + g * 0.7 - 0.6
    d0 = 0.0 + g * 0.6 - 0.5
    a2 = d2
    a1 = d1 + g * lam * a2
    a0 = d0 + g * lam * a1
    adv, ret = gae(r, v, m, g, lam)
    # float64, the same recursion by hand (this and the next line): a few ulp (2.2e-16); allclose default
    assert torch.allclose(adv, torch.tensor([[a0, a1, a2]], dtype=D))
    assert torch.allclose(ret, adv + v)


def test_gae_skips_inserted_tokens_as_if_they_were_not_there():
    """A multi-turn response (mask 0 on inserted tool tokens, right padding past the end): GAE
    equals GAE over its sampled tokens compressed (each row separately, float64), and is 0 at
    the skipped positions; with a contiguous mask it is the textbook recursion (test above)."""
    torch.manual_seed(0)
    b, w, g, lam = 5, 17, 0.95, 0.9
    m = torch.rand(b, w) < 0.6
    m[:, -3:] = False  # padding
    m[0] = False  # an empty row
    r, v = torch.randn(b, w, dtype=D), torch.randn(b, w, dtype=D)
    adv, ret = gae(r, v, m, g, lam)
    for k in range(b):
        idx = m[k].nonzero().squeeze(-1)
        want_adv, want_ret = torch.zeros(w, dtype=D), torch.zeros(w, dtype=D)
        if idx.numel():
            a, rt = gae(r[k, idx][None], v[k, idx][None], torch.ones(1, idx.numel()), g, lam)
            want_adv[idx], want_ret[idx] = a[0], rt[0]
        # float64: the same operations on the same values (skipped positions add exact zeros); allclose default
        assert torch.allclose(adv[k], want_adv) and torch.allclose(ret[k], want_ret), k
    assert bool((adv[~m] == 0).all()) and bool((ret[~m] == 0).all())
