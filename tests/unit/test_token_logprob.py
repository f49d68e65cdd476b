"""The fused, chunked log-prob / entropy (engines.training.token_logprob) against float64 autograd of
the textbook formula, its gradient by finite differences, and its memory invariant: no
float32 [N, V] is saved for backward. The windowed LM path (logits_to_keep) equals the full
forward of an HF model."""

from __future__ import annotations

import pytest
import torch

from spmd_rl.engines.training.logprobs import build_batch, lm_response_logprobs, logit_window, response_logprobs
from spmd_rl.engines.training.token_logprob import SamplingPolicy, token_logprob


def _reference(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    x = logits.double() / temperature
    logp = torch.log_softmax(x, -1)
    return logp.gather(-1, targets[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_elements", [1 << 24, 23])  # one chunk; several chunks of 2 rows (V = 11)
def test_values_and_gradients_match_float64_autograd(temperature, chunk_elements):
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11, dtype=torch.float64) * 3
    targets = torch.randint(0, 11, (3, 5))
    g_lp, g_ent = torch.randn(3, 5, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)
    a = logits.clone().requires_grad_(True)
    lp, ent = token_logprob(a, targets, SamplingPolicy(temperature), with_entropy=True, chunk_elements=chunk_elements)
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    b = logits.clone().requires_grad_(True)
    rlp, rent = _reference(b, targets, temperature)
    ((rlp * g_lp).sum() + (rent * g_ent).sum()).backward()
    # float32 kernel vs float64: logits |x/T| <= ~15 rounded to float32 (|x| x 6e-8 each); measured 5.5e-6, ratio 0.53
    assert torch.allclose(lp.double(), rlp, atol=1e-5) and torch.allclose(ent.double(), rent, atol=1e-5)
    # float32 backward vs float64 autograd, same input rounding as above; measured 8.6e-6, ratio 0.44
    assert torch.allclose(a.grad, b.grad, atol=1e-5)


def test_gradcheck_finite_differences():
    """The hand-written backward against torch's numerical Jacobian (float64 inputs are upcast
    to float32 inside, hence the loose tolerance)."""
    torch.manual_seed(1)
    logits = torch.randn(4, 7, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 7, (4,))
    fn = lambda x: token_logprob(x, targets, SamplingPolicy(0.9), with_entropy=True, chunk_elements=14)  # noqa: E731
    # central differences of a float32 kernel: eps_f32 x |f| / 1e-3 ~ 1e-4 plus O(1e-6) truncation (see docstring)
    assert torch.autograd.gradcheck(fn, (logits,), eps=1e-3, atol=2e-3, rtol=1e-2, fast_mode=False)


def test_no_float32_vocab_tensor_is_saved_for_backward():
    """The memory invariant: what autograd keeps is the caller's logits (bf16 here) plus [N]
    vectors; an unfused float32 log_softmax keeps a float32 [N, V]."""
    n, vocab = 64, 1000
    logits = torch.randn(n, vocab, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, vocab, (n,))

    def saved(fn) -> list[tuple[torch.dtype, int]]:
        seen: list[tuple[torch.dtype, int]] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append((t.dtype, t.numel())) or t, lambda t: t):
            fn()
        return seen

    fused = saved(lambda: token_logprob(logits, targets, SamplingPolicy(), with_entropy=True, chunk_elements=4096))
    unfused = saved(lambda: torch.log_softmax(logits.float(), -1).gather(-1, targets[:, None]))
    assert not [s for s in fused if s[0] == torch.float32 and s[1] >= n * vocab], fused
    assert [s for s in unfused if s[0] == torch.float32 and s[1] >= n * vocab]
    lp, _ = token_logprob(logits, targets)
    lp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16


def test_bf16_logits_match_the_float32_formula_of_the_same_values():
    torch.manual_seed(2)
    logits = (torch.randn(6, 50) * 4).bfloat16()
    targets = torch.randint(0, 50, (6,))
    lp, ent = token_logprob(logits, targets, SamplingPolicy(), with_entropy=True)
    rlp, rent = _reference(logits.float(), targets, 1.0)
    # bf16 -> float32 is exact; float32 kernel vs float64 on |x| <= ~16: measured 4.4e-6, ratio 0.2
    assert torch.allclose(lp.double(), rlp, atol=1e-5) and torch.allclose(ent.double(), rent, atol=1e-5)


def test_windowed_lm_path_equals_the_full_forward(tiny_model):
    """Prompts of different lengths: the LM head on logit_window only gives the same response
    log-probs and entropies (and gradients) as the full forward's logits."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    prompts = [torch.tensor([5, 6, 7, 8, 9]), torch.tensor([10, 11, 12]), torch.tensor([13, 14, 15, 16])]
    responses = [torch.tensor([20, 21]), torch.tensor([22, 23, 24, 25]), torch.tensor([26])]
    batch = build_batch(prompts, responses, 0)
    assert logit_window(batch) == (2, 6)  # shortest prompt ends at 3 (predictor 2); longest sample ends at 7
    lp, ent = lm_response_logprobs(model, batch, with_entropy=True, policy=SamplingPolicy(0.8))
    grads_window = torch.autograd.grad(lp.sum() + ent.sum(), model.model.embed_tokens.weight)[0]
    full = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    rlp, rent = response_logprobs(full, batch, with_entropy=True, policy=SamplingPolicy(0.8))
    grads_full = torch.autograd.grad(rlp.sum() + rent.sum(), model.model.embed_tokens.weight)[0]
    # float32: the LM head on the window vs the full rows (this and the next line); measured bit-equal, another gemm
    # blocking would differ by ~eps 6e-8 x |lp|
    assert torch.allclose(lp, rlp, atol=1e-5) and torch.allclose(ent, rent, atol=1e-5)
    assert torch.allclose(grads_window, grads_full, atol=1e-5)
    for k, (p, r) in enumerate(zip(prompts, responses)):  # and both equal the float64 formula
        for j, tok in enumerate(r.tolist()):
            row = full[k, len(p) + j - 1].detach().double() / 0.8
            # float32 kernel vs float64 on the same float32 logits, |x/T| ~ 10: eps 6e-8 x ~10; measured 6.8e-7
            assert abs(lp[k, j].item() - (row[tok] - torch.logsumexp(row, 0)).item()) < 1e-5


def test_trim_drops_only_unused_padding_and_changes_no_log_prob(tiny_model):
    """A micro-batch trimmed to its own longest sample gives the same response log-probs as
    the one padded to the iteration's width (right padding: nothing moves)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    prompts = [torch.tensor([5, 6, 7]), torch.tensor([10, 11, 12, 13]), torch.tensor([14, 15])]
    responses = [torch.tensor([20, 21, 22, 23, 24, 25]), torch.tensor([22]), torch.tensor([26, 27])]
    wide = build_batch(prompts, responses, 0)
    micro = wide[1:]
    small = micro.trim()
    assert small.input_ids.shape == (2, 5) and small.mask.shape == (2, 2)
    assert (
        small.mask.sum() == micro.mask.sum()
        and (small.input_ids * small.attention_mask).sum() == (micro.input_ids * micro.attention_mask).sum()
    )
    with torch.no_grad():
        lp_small, _ = lm_response_logprobs(model, small)
        lp_wide, _ = lm_response_logprobs(model, micro)
    # float32: trimming changes only the SDPA/matmul width; measured 0 (AVX512), 1.8e-7 (AVX2 kernels)
    assert torch.allclose(lp_small, lp_wide[:, :2], atol=1e-6) and (lp_wide[:, 2:] == 0).all()


def test_length_order_sorts_within_mini_batches_only():
    from types import SimpleNamespace

    from spmd_rl.trainer.stages.minibatch import length_order, mini_batches

    cfg = SimpleNamespace(actor=SimpleNamespace(mini_batch_size=2, ppo_epochs=1), rollout=SimpleNamespace(n=4))
    lengths = torch.tensor([3, 9, 1, 7, 5, 5, 2, 8, 4, 6, 10, 1])  # this rank: 12 rows; dp 2 -> 4 rows per mini-batch
    order = length_order(cfg, 2, lengths)
    assert sorted(order.tolist()) == list(range(12))
    assert mini_batches(cfg, 2, 12) == [slice(0, 4), slice(4, 8), slice(8, 12)]
    for sl in mini_batches(cfg, 2, 12):
        got = order[sl]
        assert set(got.tolist()) == set(range(12)[sl])  # same membership: the same optimizer steps
        assert lengths[got].tolist() == sorted(lengths[sl].tolist(), reverse=True)
    assert order[4:8].tolist() == [7, 4, 5, 6]  # stable among equal lengths


def _hf_warped(logits: torch.Tensor, policy: SamplingPolicy) -> torch.Tensor:
    """Independent reference: transformers' own warpers (temperature, then top-k, then top-p,
    as ``generate`` orders them) in float64, then log_softmax: [n, V] (-inf where dropped)."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    x = TemperatureLogitsWarper(policy.temperature)(None, logits.double().reshape(-1, logits.shape[-1]))
    if policy.top_k > 0:
        x = TopKLogitsWarper(policy.top_k)(None, x)
    if policy.top_p < 1:
        x = TopPLogitsWarper(policy.top_p)(None, x)
    return torch.log_softmax(x, -1)


def _hf_truncated(
    logits: torch.Tensor, targets: torch.Tensor, policy: SamplingPolicy
) -> tuple[torch.Tensor, torch.Tensor]:
    """(lp, entropy) of each row under ``_hf_warped``."""
    logp = _hf_warped(logits, policy)
    ent = -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(-1)
    return logp.gather(-1, targets.reshape(-1, 1)).squeeze(-1).view(targets.shape), ent.view(targets.shape)


TRUNCATED = [SamplingPolicy(1.0, top_p=0.8), SamplingPolicy(0.7, top_k=5), SamplingPolicy(1.3, top_k=8, top_p=0.6)]


@pytest.mark.parametrize("policy", TRUNCATED, ids=str)
@pytest.mark.parametrize("chunk_elements", [1 << 24, 100])
def test_truncated_policy_equals_transformers_warpers(policy, chunk_elements):
    """Top-k / top-p: the log-prob of a token in the kept set and the entropy equal log_softmax
    of HF's warped logits (float64); without the truncation they do not (the test can fail)."""
    torch.manual_seed(3)
    logits = torch.randn(6, 40, dtype=torch.float64) * 2.5
    warped = _hf_warped(logits, policy)
    targets = torch.stack([torch.multinomial(row.exp(), 1)[0] for row in warped])  # drawn from the truncated policy
    lp, ent = token_logprob(logits, targets, policy, with_entropy=True, chunk_elements=chunk_elements)
    rlp, rent = _hf_truncated(logits, targets, policy)
    # float32 kernel vs float64 HF warpers on |x/T| <= ~10: measured 1.3e-6, ratio 0.06
    assert torch.allclose(lp.double(), rlp, atol=1e-5) and torch.allclose(ent.double(), rent, atol=1e-5)
    plain, _ = token_logprob(logits, targets, SamplingPolicy(policy.temperature))
    assert (plain.double() - rlp).abs().max() > 1e-2  # the untruncated softmax is another distribution


@pytest.mark.parametrize("policy", TRUNCATED, ids=str)
def test_truncated_policy_gradients_match_float64_autograd(policy):
    """The gradient flows through the kept logits only and equals autograd of the masked
    log_softmax (the kept set held fixed)."""
    torch.manual_seed(4)
    logits = torch.randn(5, 30, dtype=torch.float64) * 2
    warped = _hf_warped(logits, policy)
    targets = torch.stack([torch.multinomial(row.exp(), 1)[0] for row in warped])
    g_lp, g_ent = torch.randn(5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    a = logits.clone().requires_grad_(True)
    lp, ent = token_logprob(a, targets, policy, with_entropy=True, chunk_elements=60)
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    b = logits.clone().requires_grad_(True)
    rlp, rent = _hf_truncated(b, targets, policy)
    ((rlp * g_lp).sum() + (rent * g_ent).sum()).backward()
    # float32 backward vs float64 autograd of the masked log_softmax; measured 8.7e-7, ratio 0.035
    assert torch.allclose(a.grad, b.grad, atol=1e-5)
    assert (a.grad[warped.isinf()] == 0).all()  # nothing flows into a dropped token


def test_a_target_outside_the_kept_set_stays_finite():
    """vLLM sampled the token, so it was in vLLM's set; if the trainer's rounding drops it at the
    boundary the log-prob is taken over the kept set plus the target, never -inf."""
    logits = torch.tensor([[5.0, 4.0, 0.0, -1.0]])
    lp, ent = token_logprob(logits, torch.tensor([3]), SamplingPolicy(top_k=1), with_entropy=True)
    x = torch.tensor([5.0, -1.0])
    # float32 both sides, the same two-term logsumexp: a few ulp; allclose default rtol 1e-5
    assert torch.allclose(lp, (x[1] - torch.logsumexp(x, 0))[None]) and ent.isfinite().all()


def test_policy_of_the_rollout_config():
    from spmd_rl.config.schema import RolloutConfig

    assert SamplingPolicy.of(
        RolloutConfig(n=2, max_response_length=4, temperature=0.7, top_p=0.9, top_k=20)
    ) == SamplingPolicy(0.7, 20, 0.9)
    assert (
        SamplingPolicy.of(RolloutConfig(n=2, max_response_length=4, temperature=0.0, top_p=0.9, top_k=20))
        == SamplingPolicy()
    )  # greedy: vLLM drops both
