"""The critic-free estimators, CISPO and the rollout corrections against their papers'
formulas, written out element by element in float64 (``algos.estimators``,
``algos.policy_loss.cispo``, ``algos.rollout_correction``)."""

from __future__ import annotations

import math

import pytest
import torch

from spmd_rl.algos.core import token_rewards, whiten
from spmd_rl.algos.estimators import SEQ_ESTIMATORS, discounted_returns, group_centred
from spmd_rl.algos.policy_loss import ClipConfig, LossNorm, get_policy_loss
from spmd_rl.algos.rollout_correction import icepop_weight, mis_mask

D = torch.float64


def test_rloo_is_the_reward_minus_the_mean_of_the_other_samples():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 2.0], dtype=D)
    got = SEQ_ESTIMATORS.lookup("rloo")(r, 4, False)
    for i in range(8):
        g = (i // 4) * 4
        others = [float(r[j]) for j in range(g, g + 4) if j != i]
        # float64: a mean of 3 rewards (|r| <= 2) in another order, eps 2.2e-16 x ~4
        assert math.isclose(float(got[i]), float(r[i]) - sum(others) / 3, abs_tol=1e-12)
    # N / (N - 1) times the group-centred reward, and 0 for a constant group
    # float64: N/(N-1) times the centred reward, a few roundings; allclose default
    assert torch.allclose(got, 4 / 3 * group_centred(r, 4))
    assert SEQ_ESTIMATORS.lookup("rloo")(torch.ones(4, dtype=D), 4, False).abs().max() == 0


def test_discounted_returns_by_hand_and_over_sampled_tokens_only():
    r = torch.tensor([[1.0, 2.0, 3.0, 0.0]], dtype=D)
    m = torch.tensor([[1, 1, 1, 0]])
    g = 0.9
    # float64: the same Horner sums by hand (this and the next assert); allclose default
    assert torch.allclose(
        discounted_returns(r, m, g), torch.tensor([[1 + g * (2 + g * 3), 2 + g * 3, 3.0, 0.0]], dtype=D)
    )
    holes = torch.tensor([[1, 0, 1, 1]])  # position 1 is an inserted tool token: skipped, not an end
    r2 = torch.tensor([[1.0, 9.0, 2.0, 3.0]], dtype=D)
    assert torch.allclose(
        discounted_returns(r2, holes, g), torch.tensor([[1 + g * (2 + g * 3), 0.0, 2 + g * 3, 3.0]], dtype=D)
    )


def test_reinforce_pp_advantages_are_whitened_returns_with_the_kl_in_the_reward():
    torch.manual_seed(0)
    b, w, beta, g = 6, 5, 0.1, 1.0
    lengths = torch.tensor([5, 3, 4, 1, 5, 2])
    mask = torch.arange(w)[None, :] < lengths[:, None]
    scores = torch.randn(b, dtype=D)
    kl = torch.rand(b, w, dtype=D) * mask
    returns = discounted_returns(token_rewards(scores, lengths, w, kl, beta), mask, g)
    for k in range(b):  # G_t = s - beta sum_{k >= t} kl_k at gamma 1
        for t in range(int(lengths[k])):
            # float64: <= 5 KL terms (O(0.1)) summed in another order, eps 2.2e-16 x O(1)
            assert math.isclose(
                float(returns[k, t]), float(scores[k]) - beta * float(kl[k, t : lengths[k]].sum()), abs_tol=1e-12
            )
    vals = returns[mask]
    white = whiten(returns, mask, float(mask.sum()), float(vals.sum()), float((vals**2).sum()))
    # float64: whiten adds eps 1e-8 to the variance (relative 5e-9 / var), the moment formula cancels little
    assert torch.allclose(white[mask], (vals - vals.mean()) / vals.std(unbiased=True), atol=1e-6)


def test_cispo_gradient_is_the_detached_clipped_weight_times_the_advantage():
    torch.manual_seed(1)
    logp = (torch.rand(3, 4, dtype=D) * -2).requires_grad_()
    old = logp.detach() + torch.tensor(
        [[0.0, 0.5, -0.5, 0.1]] * 3, dtype=D
    )  # ratios exp(-0.0), exp(-0.5), exp(0.5), exp(-0.1)
    adv = torch.tensor([1.0, -2.0, 0.5], dtype=D)
    mask = torch.ones(3, 4, dtype=torch.bool)
    out = get_policy_loss("cispo")(logp, old, adv, mask, ClipConfig(0.2, 0.28, None, "token-mean"), LossNorm(12.0, 3.0))
    out.loss.backward()
    ratio = torch.exp(logp.detach() - old)
    want = -ratio.clamp(0.8, 1.28) * adv[:, None] / 12.0  # d/dlogp of -sg(w) A logp / T
    # float64, the same clamp and products; allclose default
    assert torch.allclose(logp.grad, want)
    assert float(out.clipped_tokens) == 6.0  # exp(-0.5) < 0.8 and exp(0.5) > 1.28 in every row; exp(-0.1) is inside


def test_icepop_masks_tokens_and_mis_rejects_sequences_outside_the_band():
    old = torch.log(torch.tensor([[1.0, 0.4, 2.5, 1.2], [0.9, 1.1, 1.0, 1.0]], dtype=D))
    roll = torch.zeros(2, 4, dtype=D)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    assert (icepop_weight(old, roll, (0.5, 2.0)) > 0).tolist() == [
        [True, False, False, True],
        [True, True, True, True],
    ]  # the kept tokens
    # IcePop's published weight rho [a <= rho <= b] (a bare mask weighted every kept token 1): float64 formula
    rho = [[1.0, 0.4, 2.5, 1.2], [0.9, 1.1, 1.0, 1.0]]
    want = torch.tensor([[r if 0.5 <= r <= 2.0 else 0.0 for r in row] for row in rho], dtype=D)
    # float64: exp(log rho) returns rho within a few ulp (2.2e-16), zeros exact
    assert torch.allclose(icepop_weight(old, roll, (0.5, 2.0)), want, rtol=1e-12, atol=0)
    # geometric means: (1 * 0.4 * 2.5 * 1.2)^(1/4) = 1.2^(1/4) ~ 1.047; (0.9 * 1.1 * 1.0)^(1/3) ~ 0.997
    assert mis_mask(old, roll, mask, (0.99, 1.01)).tolist() == [[0.0] * 4, [1.0] * 4]
    assert mis_mask(old, roll, mask, (0.5, 2.0)).tolist() == [[1.0] * 4, [1.0] * 4]


def _advantage_call(rank: int, algo: str, values: bool):
    """A StageCall for the advantage stage: rank 0 holds four samples of one group, rank 1 none."""
    from types import SimpleNamespace

    rows = [(1.0, 3), (0.0, 2), (1.0, 4), (0.5, 1)] if rank == 0 else []
    columns = {"reward": [torch.tensor(r) for r, _ in rows], "response_length": [torch.tensor(L) for _, L in rows]}
    if values:
        columns["values"] = [torch.linspace(0.1, 0.4, L) for _, L in rows]
    batch = type("Batch", (), {"columns": columns, "__len__": lambda self: len(rows)})()
    algorithm = SimpleNamespace(name=algo, gamma=0.9, lam=0.8, kl_coef=0.0, kl_estimator="k1")
    run = SimpleNamespace(
        cfg=SimpleNamespace(algorithm=algorithm, rollout=SimpleNamespace(n=4)),
        lay=SimpleNamespace(train=SimpleNamespace(group=1)),
        group=None,
        replicas=None,
    )
    return SimpleNamespace(view=run, batch=batch, stage=SimpleNamespace(inputs=("values",) if values else ()))


def _advantage_rank(rank: int, algo: str, values: bool, store: str, out) -> None:
    """One rank of a real 2-rank gloo world (forked): the advantage stage, then its advantages."""
    from datetime import timedelta

    import torch.distributed as dist

    from spmd_rl.trainer.stages.advantage import advantage

    torch.set_num_threads(1)  # the parent's OpenMP thread team does not survive the fork
    dist.init_process_group(
        "gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2, timeout=timedelta(seconds=15)
    )
    try:
        result = advantage(_advantage_call(rank, algo, values))
        out.put((rank, [a.tolist() for a in (result.columns or {}).get("advantages", [])]))
    except Exception as e:  # a collective that never pairs up times out here
        out.put((rank, repr(e)))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("algo,values", [("reinforce_pp", False), ("reinforce_pp_baseline", False), ("ppo", True)])
def test_a_rank_with_no_samples_still_enters_the_whitening_all_reduce(tmp_path, algo, values):
    """The advantage stage's whitening sums moments over the DP ranks: a rank whose share is empty
    must take part in that real all-reduce too (two forked gloo ranks here), or the other rank
    waits in it until the collective times out. Rank 0's advantages are then whitened with the
    moments of its own tokens only (rank 1 adds zeros), recomputed here in float64."""
    import multiprocessing as mp

    from spmd_rl.algos.core import gae, masked_moments

    ctx = mp.get_context("fork")  # the parent's imports, no interpreter start
    out = ctx.Queue()
    procs = [ctx.Process(target=_advantage_rank, args=(r, algo, values, str(tmp_path / "store"), out)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(30)
    assert got[1] == [], got[1]
    call = _advantage_call(0, algo, values)
    cols = call.batch.columns
    lengths = torch.stack(cols["response_length"]).long()
    mask = torch.arange(4)[None, :] < lengths[:, None]
    scores = torch.stack(cols["reward"]).to(D)
    if algo == "reinforce_pp_baseline":
        scores = group_centred(scores, 4)
    rewards = token_rewards(scores, lengths, 4, mask=mask)
    if values:
        v = torch.zeros(4, 4, dtype=D)
        for k, x in enumerate(cols["values"]):
            v[k, : len(x)] = x.to(D)
        want, _ = gae(rewards, v * mask, mask, 0.9, 0.8)
    else:
        want = discounted_returns(rewards, mask, 0.9)
    white = whiten(want, mask, *masked_moments(want, mask))
    assert isinstance(got[0], list), got[0]
    for k, L in enumerate(lengths.tolist()):
        # float32 advantages from the stage (eps 6e-8 x |A| <= ~2) vs the float64 formula; measured 2.9e-8
        assert torch.allclose(torch.tensor(got[0][k], dtype=D), white[k, :L], atol=1e-6), (k, got[0][k], white[k, :L])


def test_the_score_of_a_trajectory_that_ends_on_inserted_tokens_reaches_its_returns():
    """A multi-turn trajectory can end on inserted tokens (a prefix break): its score goes on its
    last sampled token, so REINFORCE++'s returns and GAE (which skip inserted tokens) keep it. On
    the earlier code the score sat on the last, inserted, token and every return was 0."""
    from spmd_rl.algos.core import gae, token_rewards
    from spmd_rl.algos.estimators import discounted_returns

    lengths = torch.tensor([5, 3])
    mask = torch.tensor([[1, 1, 0, 1, 0], [1, 1, 1, 0, 0]], dtype=torch.bool)  # row 0 ends on an inserted token
    scores = torch.tensor([1.0, 2.0], dtype=torch.float64)
    r = token_rewards(scores, lengths, 5, mask=mask)
    assert r[0].tolist() == [0, 0, 0, 1.0, 0] and r[1].tolist() == [0, 0, 2.0, 0, 0]
    ret = discounted_returns(r, mask, 0.5)
    assert ret[0].tolist() == [0.25, 0.5, 0.0, 1.0, 0.0]  # gamma^k over the sampled positions, inserted ones skipped
    adv, returns = gae(r, torch.zeros(2, 5, dtype=torch.float64), mask, 1.0, 1.0)
    assert returns[0, 0] == 1.0 and returns[1, 0] == 2.0
    assert token_rewards(scores, lengths, 5)[0, 4] == 1.0  # without a mask: the last response token, as before
