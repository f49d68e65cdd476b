"""Engine pieces without a process group: log-prob gathering against a float64 reference,
LR schedule formula, storage-level host swap, ledger."""

from __future__ import annotations

import math

import pytest
import torch

from spmd_rl.distributed.accelerator import detect
from spmd_rl.engines.training.logprobs import build_batch, response_logprobs
from spmd_rl.engines.training.schedule import lr_factor
from spmd_rl.reshard.ledger import Ledger
from spmd_rl.reshard.swap import HostSwap, balanced_groups, resident_bytes


def test_response_logprobs_match_float64_reference():
    torch.manual_seed(0)
    prompts = [torch.tensor([5, 6, 7]), torch.tensor([8])]
    responses = [torch.tensor([1, 2]), torch.tensor([3, 4, 9])]
    b = build_batch(prompts, responses, pad_id=0)
    logits = torch.randn(2, b.input_ids.shape[1], 11)
    lp, ent = response_logprobs(logits, b, with_entropy=True)
    for k, (p, r) in enumerate(zip(prompts, responses)):
        for j, tok in enumerate(r.tolist()):
            row = logits[k, len(p) + j - 1].double()
            ref = row[tok] - torch.logsumexp(row, 0)
            # float32 log-softmax of float32 logits (|x| <= ~4, V=11) vs float64: eps 6e-8 x ~4; measured 2.2e-7
            assert abs(lp[k, j].item() - ref.item()) < 1e-6
            probs = torch.softmax(row, 0)
            # float32 entropy, an 11-term sum of p x (eps 6e-8 x ~10); measured 4e-7
            assert abs(ent[k, j].item() - (-(probs * probs.log()).sum()).item()) < 1e-5
        assert (lp[k, len(r) :] == 0).all() and b.mask[k].sum() == len(r)
    assert b.input_ids[0].tolist()[:5] == [5, 6, 7, 1, 2] and b.attention_mask.sum(1).tolist() == [5, 4]


@pytest.mark.parametrize("kind", ["constant", "linear", "cosine"])
def test_lr_factor(kind):
    assert lr_factor(0, kind, 4, 20) == 0.25 and lr_factor(3, kind, 4, 20) == 1.0
    end = {"constant": 1.0, "linear": 0.0, "cosine": 0.0}[kind]
    # python float64: 0.5 (1 + cos(pi)) is 0 to 1 ulp; abs because the expected value may be 0
    assert lr_factor(20, kind, 4, 20) == pytest.approx(end, abs=1e-12)
    mid = {"constant": 1.0, "linear": 0.5, "cosine": 0.5 * (1 + math.cos(math.pi * 0.5))}[kind]
    # python float64, the same formula: a few ulp vs approx's default rel 1e-6
    assert lr_factor(12, kind, 4, 20) == pytest.approx(mid)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_host_swap_round_trip_is_bit_exact_and_frees_storage(threads):
    acc = detect("cpu")
    base = torch.randn(10, 4)
    views = [base[:5], base[5:], torch.randn(3).to(torch.bfloat16), torch.tensor([float("nan"), -0.0, 1e-45])]
    before = [v.clone() for v in views]
    swap = HostSwap(acc, threads=threads)
    assert swap.threads == threads  # on CPU the copies run in parallel groups
    swap.track(views)
    assert swap.nbytes == 160 + 6 + 12  # one storage for both views of base
    host_buffers = [h.data_ptr() for h in swap._host]
    assert len({h.untyped_storage().data_ptr() for h in swap._host}) == 1  # one host arena for the whole set
    assert sum(h.numel() for h in swap._host) == swap.nbytes == swap._host[0].untyped_storage().nbytes()  # no slack
    swap.offload()
    assert resident_bytes(views) == 0
    swap.reload()
    for a, b in zip(views, before):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    swap.track(views)  # same sizes: host buffers are reused, not reallocated
    assert [h.data_ptr() for h in swap._host] == host_buffers


def test_balanced_groups_cover_every_storage_once_and_balance_bytes():
    sizes = [100, 1, 50, 50, 3, 98, 2]
    groups = balanced_groups(sizes, 2)
    assert sorted(i for g in groups for i in g) == list(range(len(sizes)))
    totals = [sum(sizes[i] for i in g) for g in groups]
    assert max(totals) - min(totals) <= max(sizes) and balanced_groups(sizes, 1) == [
        sorted(range(7), key=lambda i: -sizes[i])
    ]
    assert balanced_groups([5], 4) == [[0]]  # no empty groups


def test_ledger_peak_and_unknown_category():
    led = Ledger()
    led.record("a", actor_params=10, temp=5)
    led.record("b", rollout_weights=7)
    assert led.total("a") == 15 and led.peak() == 15 and "actor_params" in led.table()
    with pytest.raises(ValueError):
        led.record("c", bogus=1)
