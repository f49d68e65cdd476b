"""The registered policy objectives: split invariance in float64, GSPO and TIS by hand, and
DAPO's group selection."""

from __future__ import annotations

import math

import pytest
import torch

from spmd_rl.algos.dynamic_sampling import GroupSelection, signal_groups
from spmd_rl.algos.policy_loss import (
    AGG_MODES,
    POLICY_LOSSES,
    ClipConfig,
    LossNorm,
    aggregate,
    get_policy_loss,
    local_norm,
    tis_weight,
)

D = torch.float64


def _batch(b: int = 12, r: int = 9, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, r + 1, (b,), generator=g)
    mask = torch.arange(r)[None, :] < lengths[:, None]
    logp = (-torch.rand(b, r, generator=g, dtype=D) * 3).requires_grad_(True)
    old = logp.detach() + 0.3 * torch.randn(b, r, generator=g, dtype=D)
    adv = torch.randn(b, generator=g, dtype=D)
    return logp, old, adv, mask


def _grad(logp, fn) -> torch.Tensor:
    logp.grad = None
    fn().backward()
    return logp.grad.clone()


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_objective_is_independent_of_the_split(mode, name):
    """Micro-batches of any size on any number of DP ranks (each rank's loss times the DP
    size, gradients averaged over ranks, as FSDP does) give the single-batch gradient."""
    logp, old, adv, mask = _batch()
    clip = ClipConfig(0.2, 0.28, 3.0, mode)
    loss = get_policy_loss(name)
    whole = _grad(logp, lambda: loss(logp, old, adv, mask, clip).loss)
    norm = local_norm(mask)
    for dp, micro in ((1, 1), (1, 5), (2, 3), (3, 2), (4, 3)):
        rank_rows = [list(range(r, len(mask), dp)) for r in range(dp)]  # uneven token counts per rank
        total = torch.zeros_like(whole)
        for rows in rank_rows:
            for k in range(0, len(rows), micro):
                s = rows[k : k + micro]
                g = _grad(logp, lambda s=s: loss(logp[s], old[s], adv[s], mask[s], clip, norm).loss * dp)
                total += g / dp
        # float64 round-off: O(0.1) gradients summed over <= 12 micro-batches, eps 2.2e-16 x ~10 = 1e-15 << 1e-10
        assert torch.allclose(total, whole, atol=1e-10, rtol=0), (dp, micro, (total - whole).abs().max())


def test_aggregation_uses_the_global_normaliser():
    v = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]], dtype=D)
    m = torch.tensor([[1, 1, 1], [1, 0, 0]])
    n = LossNorm(tokens=10.0, seqs=5.0)
    # exact in float64 (this and the next 2 lines): small integers over 10 or 5; approx's default rel 1e-6
    assert aggregate(v, m, "token-mean", n).item() == pytest.approx(10 / 10)
    assert aggregate(v, m, "seq-mean-token-sum", n).item() == pytest.approx((6 + 4) / 5)
    assert aggregate(v, m, "seq-mean-token-mean", n).item() == pytest.approx((2 + 4) / 5)
    with pytest.raises(ValueError, match="token-mean"):
        aggregate(v, m, "bogus")
    with pytest.raises(ValueError, match="registered"):
        get_policy_loss("nope")


def test_gspo_sequence_ratio_by_hand():
    """s_b = exp(mean_t(logp - old)); each token's ratio has the value s_b and gradient s_b
    with respect to its own log-prob, so the token-mean of -A s_b has gradient -A s_b / 3."""
    logp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=D, requires_grad=True)
    old = torch.tensor([[-1.1, -1.9, -0.5]], dtype=D)
    m = torch.ones(1, 3)
    adv = torch.tensor([1.0], dtype=D)
    s = math.exp(((-1.0 + 1.1) + (-2.0 + 1.9) + 0.0) / 3)  # = 1.0
    out = get_policy_loss("gspo")(logp, old, adv, m, ClipConfig(0.2, 0.2, None, "token-mean"))
    # float64: the mean log-ratio is ~1e-17, so s = 1 to 1 ulp; approx's default rel 1e-6
    assert out.loss.item() == pytest.approx(-s)
    out.loss.backward()
    # float64: -s/3 to a few ulp (2.2e-16); allclose default
    assert torch.allclose(logp.grad, torch.full((1, 3), -s / 3, dtype=D))
    # a sequence ratio outside the clip range: clipped for every token of the sequence
    old2 = logp.detach() - 0.5
    out = get_policy_loss("gspo")(logp, old2, adv, m, ClipConfig(0.2, 0.2, None, "token-mean"))
    # float64: the clipped ratio is 1 + 0.2 as written, to 1 ulp; approx's default rel 1e-6
    assert out.loss.item() == pytest.approx(-1.2) and out.clipped_tokens == 3


def test_tis_weight_is_truncated_and_detached():
    old = torch.tensor([0.0, 0.0, 0.0], dtype=D, requires_grad=True)
    rollout = torch.tensor([0.0, -0.5, -3.0], dtype=D)
    w = tis_weight(old, rollout, 2.0)
    # float64: exp(0) = 1, exp(0.5) the same libm value, the cap 2.0 exact; approx's default rel 1e-6
    assert w.tolist() == pytest.approx([1.0, math.exp(0.5), 2.0])
    assert not w.requires_grad
    logp, oldp, adv, mask = _batch(4, 5)
    clip = ClipConfig(0.2, 0.2, None, "token-mean")
    plain = get_policy_loss("vanilla")(logp, oldp, adv, mask, clip).loss
    weighted = get_policy_loss("vanilla")(logp, oldp, adv, mask, clip, weight=torch.full_like(logp, 2.0)).loss
    # float64: a weight of 2.0 scales exactly (a power of two); approx's default rel 1e-6
    assert weighted.item() == pytest.approx(2 * plain.item())


def test_group_selection_keeps_the_first_signal_groups():
    n = 2
    sel = GroupSelection(target=3)
    sel.add_round([0, 1, 2, 3], torch.tensor([1.0, 1, 0, 1, 0, 0, 1, 0]), n)  # groups 1 and 3 carry signal
    assert not sel.done and sel.kept == [1, 3] and sel.discarded == [0, 2]
    sel.add_round([4, 5, 6, 7], torch.tensor([0.0, 0, 1, 0, 0, 1, 1, 1]), n)  # 5 and 6; 6 is beyond the target
    assert sel.done and sel.final() == ([1, 3, 5], 0) and sel.rounds == 2
    short = GroupSelection(target=3)
    short.add_round([0, 1, 2], torch.tensor([1.0, 1, 1, 0, 0, 0]), n)
    groups, missing = short.final()
    assert missing == 2 and groups == [0, 1, 2]  # 1 signal group, topped up with the 2 latest constant ones
    assert signal_groups(torch.tensor([1.0, 1, 1, 0]), 2).tolist() == [False, True]
