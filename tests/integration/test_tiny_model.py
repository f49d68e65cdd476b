"""The tiny model builder: a standard HF folder that transformers and vLLM load."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import _PRELOAD, REPO, subprocess_env


def test_builder_writes_loadable_folder(tmp_path):
    out = tmp_path / "tiny"
    subprocess.run(
        [
            sys.executable,
            str(REPO / "tools/make_tiny_model.py"),
            "--out",
            str(out),
            "--max-steps",
            "10",
            "--eval-every",
            "5",
            "--n-test",
            "50",
        ],
        check=True,
        capture_output=True,
    )
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert 2e5 < sum(p.numel() for p in model.parameters()) < 5e6
    text = tok.apply_chat_template([{"role": "user", "content": "12+5="}], add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\n12+5=<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text, add_special_tokens=False).input_ids
    assert tok.decode(ids) == text  # byte-level: newlines survive the Qwen2 tokenizer class
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    train = [json.loads(l) for l in (out / "train.jsonl").read_text().splitlines()]
    test = [json.loads(l) for l in (out / "test.jsonl").read_text().splitlines()]
    assert len(test) == 50 and len(train) == 100 * 100 - 50
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    a, b = test[0]["prompt"].rstrip("=").split("+")
    assert int(test[0]["answer"]) == int(a) + int(b)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert torch.isfinite(logits).all() and logits.shape[-1] == model.config.vocab_size


@pytest.mark.slow
def test_warm_start_answers_some_but_not_most(tiny_model):
    """The builder reports its warm start's greedy accuracy; measured independently here (vLLM
    greedy through ``spmd-rl eval`` and the exact_match rule, not the builder's HF loop), the
    model answers some held-out prompts but not most, and the report is what it measures."""
    report = json.loads((tiny_model / "warmstart.json").read_text())
    cli_eval = f"{REPO / 'spmd_rl/cli.py'} eval"
    forked_before = _PRELOAD.forks(cli_eval)
    res = subprocess.run(
        [sys.executable, "-m", "spmd_rl.cli", "eval", str(tiny_model), "--data", str(tiny_model / "test.jsonl")],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["prompts"] == report["n_test"] == 500
    assert 0.1 <= got["accuracy"] <= 0.5, got
    # greedy answers on 500 prompts: float32 near-ties may flip a few between machines; 0.03 = 15 prompts
    assert abs(got["accuracy"] - report["test_accuracy"]) <= 0.03, (got, report)
    if _PRELOAD.sockets:  # the CLI's eval ran as a copy past the imports, not importing by itself
        assert _PRELOAD.forks(cli_eval) == forked_before + 1, "spmd-rl eval did not run as a preload copy"
    assert "INFO" not in res.stderr, res.stderr[-2000:]  # vLLM's chatter stays off the terminal


@pytest.mark.slow
def test_vllm_generates_like_hf(tiny_model):
    res = subprocess.run(
        [sys.executable, str(REPO / "tests/helpers/vllm_one_prompt.py"), str(tiny_model), "36+31="],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["vllm"], got
    # HF pads after EOS; compare up to and including vLLM's EOS
    assert got["hf"][: len(got["vllm"])] == got["vllm"], got


def test_tool_model_step_loss_is_the_one_padded_batch_loss_with_less_padding():
    """tools/make_tool_model.py pads tool and direct conversations apart; the step's loss and
    gradients are those of the one batch padded to the longest (the mean over every labelled
    token), computed on fewer padded positions."""
    sys.path.insert(0, str(REPO / "tools"))
    import random

    from make_tiny_model import build_model, build_tokenizer, pad
    from make_tool_model import batch, conversation, make_task, sft_loss

    tok = build_tokenizer()
    model = build_model(tok, 0)
    rows = make_task(0, 32, 4)[0][:16]
    parts = batch(tok, rows, random.Random(1), tool_fraction=0.5)
    drawn = random.Random(1)
    kinds = [drawn.random() < 0.5 for _ in rows]
    whole = pad(tok, [conversation(tok, r, t) for r, t in zip(rows, kinds)])
    assert len(parts) == 2 and sum(p[0].shape[0] for p in parts) == 16
    assert sum(p[0].numel() for p in parts) < 0.75 * whole[0].numel()  # the padding saved
    split = sft_loss(model, parts)
    grads = torch.autograd.grad(split, list(model.parameters()))
    ids, att, lab = whole
    one = model(input_ids=ids, attention_mask=att, labels=lab).loss
    want = torch.autograd.grad(one, list(model.parameters()))
    # float32: the mean loss over labelled tokens from 2 padded parts vs 1, sums of ~1e3 terms (eps 6e-8 x ~100)
    assert abs(split.item() - one.item()) < 1e-5 * one.item()
    # float32 gradients of other padded shapes: rel ~1e-6; atol 1e-7 for near-zero elements (fresh init, ~1e-3)
    assert all(torch.allclose(g, w, rtol=1e-4, atol=1e-7) for g, w in zip(grads, want))
