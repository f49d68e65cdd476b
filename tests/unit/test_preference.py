"""DPO's pieces without a process group: the loss against its formula in float64, the
preference file's rows, the pairing of samples, the graph and the config rules."""

from __future__ import annotations

import json
import math

import pytest
import torch

from spmd_rl.algos.preference import dpo, get_preference_loss
from spmd_rl.config.loader import load_config
from spmd_rl.recipe.rules import check
from spmd_rl.recipe.graph import stages_for
from spmd_rl.data.preferences import load_preferences
from spmd_rl.trainer.stages.preference import pair_order
from tests.conftest import REPO

QUICKSTART = REPO / "configs/quickstart_dpo.yaml"


def _reference(pc, pr, rc, rr, beta, eps):
    h = beta * ((pc - rc) - (pr - rr))
    log_sig = lambda x: -math.log1p(math.exp(-x))  # noqa: E731
    return -(1 - eps) * log_sig(h) - eps * log_sig(-h)


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_dpo_loss_is_the_formula_in_float64(eps):
    g = torch.Generator().manual_seed(0)
    pc, pr, rc, rr = (torch.randn(7, generator=g, dtype=torch.float64) * 5 for _ in range(4))
    out = dpo(pc, pr, rc, rr, 0.3, eps)
    want = torch.tensor(
        [_reference(*(float(t[k]) for t in (pc, pr, rc, rr)), 0.3, eps) for k in range(7)], dtype=torch.float64
    )
    # float64: the same log-sigmoid written another way, |loss| <= ~10 x eps 2.2e-16; measured 4.4e-16
    assert torch.allclose(out.loss, want, atol=1e-12, rtol=0)
    # float64, the same products; allclose default
    assert torch.allclose(out.chosen_reward, 0.3 * (pc - rc)) and torch.allclose(out.rejected_reward, 0.3 * (pr - rr))
    assert get_preference_loss("dpo") is dpo


def test_dpo_gradient_raises_chosen_and_lowers_rejected():
    pc, pr = torch.zeros(3, requires_grad=True), torch.zeros(3, requires_grad=True)
    dpo(pc, pr, torch.zeros(3), torch.zeros(3), 0.5).loss.sum().backward()
    assert (pc.grad < 0).all() and (pr.grad > 0).all()  # descent raises log pi(chosen), lowers log pi(rejected)
    # exact: beta/2 = 0.25 and sigmoid(0) = 0.5 are dyadic in float32; allclose default
    assert torch.allclose(pc.grad, torch.full((3,), -0.25)) and torch.allclose(pr.grad, -pc.grad)  # beta x sigmoid(0)


def test_preference_rows_are_tokenised_with_eos_and_bad_rows_skipped(tmp_path, tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    rows = [
        {"prompt": "1+2=", "chosen": "3", "rejected": "4"},
        {"prompt": "1+1=", "chosen": "2"},
        {"prompt": "2+2=", "chosen": "4", "rejected": "4"},
        {"prompt": "5+5=", "chosen": "10" * 20, "rejected": "9"},
        {"prompt": "3+3=", "chosen": "", "rejected": "5"},
    ]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = load_preferences(path, tok, "prompt", "chosen", "rejected", 32, 8)
    assert got.rows == [0] and got.pairs[0] == (
        tok.encode("3") + [tok.eos_token_id],
        tok.encode("4") + [tok.eos_token_id],
    )
    assert got.skipped == {
        "missing column 'rejected'": [1],
        "chosen equals rejected": [2],
        "response of 41 tokens > rollout.max_response_length=8": [3],
        "empty 'chosen'": [4],
    }
    path.write_text(json.dumps(rows[1]) + "\n")
    with pytest.raises(ValueError, match="no usable preference rows.*missing column 'rejected': 1"):
        load_preferences(path, tok, "prompt", "chosen", "rejected", 32, 8)


def test_batched_tokenization_equals_each_rows_own_calls(tmp_path, tiny_model):
    """``load_preferences`` tokenizes each column in one call; every kept row's prompt and pair
    are what transformers gives for that row alone (the chat template's user turn; the response
    text plus eos), in row order, with skipped rows in between (a batch shifted by one row, or
    the template applied to a response, fails here)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    rows = [json.loads(line) for line in (tiny_model / "preferences_train.jsonl").read_text().splitlines()[:100]]
    rows.insert(5, {"prompt": "1+1=", "chosen": "2", "rejected": "2"})  # skipped before tokenizing
    rows.insert(9, {"prompt": "9" * 60, "chosen": "1", "rejected": "2"})  # skipped by its token count
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = load_preferences(path, tok, "prompt", "chosen", "rejected", 32, 64)
    eos = [tok.eos_token_id]

    def prompt(text: str) -> list[int]:
        return list(
            tok.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )

    want = [
        (i, prompt(r["prompt"]), (tok.encode(r["chosen"]) + eos, tok.encode(r["rejected"]) + eos))
        for i, r in enumerate(rows)
        if i not in (5, 9)
    ]
    assert list(zip(got.rows, got.prompt_ids, got.pairs)) == want
    assert got.skipped == {
        "chosen equals rejected": [5],
        f"prompt of {len(prompt(rows[9]['prompt']))} tokens > data.max_prompt_length=32": [9],
    }


def test_pairs_are_found_by_index_and_a_half_pair_is_an_error():
    chosen, rejected = pair_order([5, 4, 0, 1])
    assert chosen.tolist() == [2, 1] and rejected.tolist() == [3, 0]
    with pytest.raises(RuntimeError, match="half of the pairs"):
        pair_order([4, 0, 1])


def test_dpo_graph_has_no_rollout_and_reads_what_it_writes(tiny_model):
    cfg = load_config(QUICKSTART, [f"model.path={tiny_model}"])
    graph = stages_for(cfg)
    assert [s.name for s in graph] == ["preference_pairs", "ref_logprob", "dpo_update"]
    assert not any("rollout" in s.roles for s in graph) and graph[1].roles == ("ref",)
    lora = stages_for(load_config(QUICKSTART, [f"model.path={tiny_model}", "actor.lora.rank=4"]))
    assert lora[1].roles == ("actor",)  # the reference is the actor with adapters off


@pytest.mark.parametrize(
    "override,field",
    [
        ("rollout.n=4", "rollout.n"),
        ("eval.interval=10", "eval.interval"),
        ("stream.fuse=true", "stream.fuse"),
        ("algorithm.kl_coef=0.1", "algorithm.kl_coef"),
        ("actor.backend=megatron", "actor.backend"),
        ("rollout.environment=calculator", "rollout.environment"),
        ("rollout.temperature=0.7", "rollout.temperature"),
        ("rollout.top_k=20", "rollout.top_k"),
        ("rollout.top_p=0.9", "rollout.top_p"),
    ],
)
def test_dpo_refuses_what_it_would_ignore(tiny_model, override, field):
    cfg = load_config(QUICKSTART, [f"model.path={tiny_model}", override])
    _, violations = check(cfg, 2, 2)
    assert field in [v.field for v in violations], violations


def test_dpo_fields_are_refused_outside_dpo(tiny_model):
    cfg = load_config(
        REPO / "configs/quickstart.yaml",
        [f"model.path={tiny_model}", "algorithm.dpo_beta=0.2", "data.rejected_column=bad"],
    )
    _, violations = check(cfg, 2, 2)
    assert [v.field for v in violations] == ["algorithm.dpo_beta", "data.rejected_column"]


def test_the_run_reads_its_preference_columns(tiny_model, tmp_path):
    """``data.chosen_column`` / ``rejected_column`` pick the columns the trainer loads
    (``preferences_for``, what ``spmd_rl.train`` calls): swapped, every pair is reversed; the
    same column twice leaves no usable pair."""
    from transformers import AutoTokenizer

    from spmd_rl.data.preferences import preferences_for

    tok = AutoTokenizer.from_pretrained(tiny_model)
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "1+2=", "chosen": "3", "rejected": "4"}) + "\n")
    load = lambda *o: preferences_for(load_config(QUICKSTART, [f"model.path={tiny_model}", *o]), tok, path)  # noqa: E731
    chosen, rejected = load().pairs[0]
    assert load("data.chosen_column=rejected", "data.rejected_column=chosen").pairs[0] == (rejected, chosen)
    with pytest.raises(ValueError, match="chosen equals rejected: 1"):
        load("data.chosen_column=rejected")


def test_the_pairs_stage_reads_the_sampled_position_even_after_skipped_rows(tmp_path, tiny_model):
    """``prompt_row`` holds the sampler's position in the loaded set (what ``put_prompts``
    writes), not the file's row number: with a bad first row they differ by one."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from spmd_rl.trainer.stages.preference import preference_pairs

    tok = AutoTokenizer.from_pretrained(tiny_model)
    rows = [
        {"prompt": "0+0=", "chosen": "0"},
        {"prompt": "1+2=", "chosen": "3", "rejected": "4"},
        {"prompt": "2+2=", "chosen": "4", "rejected": "5"},
    ]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts = load_preferences(path, tok, "prompt", "chosen", "rejected", 32, 8)
    assert prompts.rows == [1, 2]
    batch = SimpleNamespace(indices=[2, 3, 0, 1], columns={"prompt_row": torch.tensor([1, 1, 0, 0], dtype=torch.int32)})
    got = preference_pairs(SimpleNamespace(view=SimpleNamespace(prompts=prompts), batch=batch)).columns["response_ids"]
    eos = tok.eos_token_id
    assert [g.tolist() for g in got] == [
        tok.encode("4") + [eos],
        tok.encode("5") + [eos],
        tok.encode("3") + [eos],
        tok.encode("4") + [eos],
    ]


def test_sequence_logprobs_are_the_full_float64_log_softmax_at_the_response_tokens(tiny_model):
    """pair_eval takes float64 only at the response positions (x_y - logsumexp x): the same
    numbers as a float64 log-softmax of the whole [batch, T, V] logits, which it no longer builds."""
    from transformers import AutoModelForCausalLM

    from spmd_rl.trainer.pair_eval import sequence_logprobs

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    prompts, responses = [[5, 9, 13], [7, 8], [3, 4, 5, 6]], [[20, 21], [30, 31, 32], [40]]
    got = sequence_logprobs(model, prompts, responses, batch=1)  # the same forward shapes as the reference below
    want = []
    with torch.no_grad():
        for p, r in zip(prompts, responses):
            full = torch.log_softmax(model(input_ids=torch.tensor([p + r])).logits.double(), -1)[0]
            want.append(sum(full[len(p) - 1 + i, t] for i, t in enumerate(r)))
    # float64 maths on the same float32 logits (same forward shapes): only float64 sum order differs, ~1e-15
    assert torch.allclose(got, torch.stack(want), rtol=0, atol=1e-9), (got, want)


def test_sequence_logprobs_never_hold_a_float64_copy_of_the_batchs_logits(tiny_model):
    """Observed through torch's dispatcher: the largest float64 tensor any op returns while
    pair_eval scores a batch of three is one response's rows [len(r), V], not the batch's
    [3, T, V] (the log-softmax the old code took, about 40 GB at a 152k vocabulary)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import AutoModelForCausalLM

    from spmd_rl.trainer.pair_eval import sequence_logprobs

    class LargestFloat64(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.dtype == torch.float64:
                    LargestFloat64.largest = max(LargestFloat64.largest, t.numel())
            return out

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    prompts, responses = [[5, 9, 13], [7, 8], [3, 4, 5, 6]], [[20, 21], [30, 31, 32], [40]]
    vocab = model.config.vocab_size
    with torch.no_grad(), LargestFloat64():
        sequence_logprobs(model, prompts, responses, batch=3)
    assert 0 < LargestFloat64.largest <= max(map(len, responses)) * vocab, (LargestFloat64.largest, vocab)
