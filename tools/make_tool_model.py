#!/usr/bin/env python
"""Build the tiny tool-using model and its task: "a*b=" with 100 <= a < 1000, 10 <= b < 100,
products the tiny model cannot compute, and the ``calculator`` environment that can.

Same architecture and tokenizer as ``tools/make_tiny_model.py``. The warm start is supervised
on two kinds of conversation, the loss on the assistant's tokens only:

- a tool conversation (``--tool-fraction`` of them): the assistant writes ``<calc>a*b</calc>``,
  the tool turn holds the product, the assistant copies it;
- a direct one: the assistant writes the product at once (which it cannot learn to compute).

``--format hermes`` writes the tool model the agent quickstart trains (``assets/tiny-agent``,
``configs/quickstart_agent.yaml``): the call is an OpenAI tool call in Hermes's form,
``<tool_call>{"name": "calc", "arguments": {"e": "a*b"}}</tool_call>``, rendered by the chat
template from the assistant message's ``tool_calls``, and every conversation starts with the
template's one-line rendering of the tool schema (``tools: calc``), as an agent's call with
``tools=[CALC]`` renders it.

So the warm-started policy calls the calculator in about that fraction of its samples and
answers directly otherwise: greedy decoding answers directly (and is almost always wrong), and
reinforcement learning with the tool has a rare, correct behaviour to make the mode; without the
tool it has nothing. ``warmstart.json`` records the tool-call rate at temperature 1, how often a
tool conversation's copy is right, and the greedy accuracy without the tool.

    python tools/make_tool_model.py --out assets/tiny-tools
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers import GenerationConfig

sys.path.insert(0, str(Path(__file__).parent))
from make_tiny_model import build_model, build_tokenizer, load_weights, pad, prompt_ids, weights_origin  # noqa: E402  (tools/ is the script's folder)


HERMES_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\ntools: ' }}"
    "{% for t in tools %}{{ t['function']['name'] }}{% if not loop.last %}, {% endif %}{% endfor %}"
    "{{ '<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message.get('tool_calls') %}{% for c in message['tool_calls'] %}"
    "{{ '<tool_call>{\"name\": \"' + c['function']['name'] + '\", \"arguments\": ' }}"
    "{% if c['function']['arguments'] is string %}{{ c['function']['arguments'] }}"
    "{% else %}{{ c['function']['arguments'] | tojson }}{% endif %}{{ '}</tool_call>' }}{% endfor %}"
    "{% else %}{{ message['content'] }}{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""``--format hermes``: the tools as one line of names, a tool call as Hermes's tags around its JSON."""
CALC = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Integer arithmetic: + - * // % and parentheses.",
        "parameters": {"type": "object", "properties": {"e": {"type": "string"}}, "required": ["e"]},
    },
}
"""The calculator's tool schema (what the agent example passes as ``tools``)."""


def tokenizer_for(fmt: str):
    """The tiny tokenizer, with the Hermes template for ``--format hermes``."""
    tok = build_tokenizer()
    if fmt == "hermes":
        tok.chat_template = HERMES_TEMPLATE
    return tok


def task_prompt_ids(tok, prompt: str, fmt: str) -> list[int]:
    """A row's prompt as the policy sees it: with the tool schema line under ``--format hermes``."""
    if fmt != "hermes":
        return prompt_ids(tok, prompt)
    return list(
        tok.apply_chat_template(
            [{"role": "user", "content": prompt}],
            tools=[CALC],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
    )


def make_task(seed: int, n_train: int, n_test: int) -> tuple[list[dict], list[dict]]:
    rng = random.Random(seed)
    pairs = {(rng.randrange(100, 1000), rng.randrange(10, 100)) for _ in range(3 * (n_train + n_test))}
    rows = [{"prompt": f"{a}*{b}=", "answer": str(a * b)} for a, b in sorted(pairs)]
    rng.shuffle(rows)
    return rows[n_test : n_test + n_train], rows[:n_test]


def conversation(tok, row: dict, tool: bool, fmt: str = "calc") -> tuple[list[int], list[int]]:
    """(ids, labels) of one supervised conversation; labels -100 outside the assistant's turns."""
    ids, labels = _conversation(tok, row["prompt"], row["answer"], tool, fmt)
    return list(ids), list(labels)


@functools.cache
def _conversation(tok, prompt: str, answer: str, tool: bool, fmt: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Cached: a tool conversation renders the chat template three times (about 0.9 ms), and the
    600 steps of 64 draw each of the 4,000 training rows about ten times."""
    a, b = prompt.rstrip("=").split("*")
    user = {"role": "user", "content": prompt}
    call = (
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "calc", "arguments": {"e": f"{a}*{b}"}}}],
        }
        if fmt == "hermes"
        else {"role": "assistant", "content": f"<calc>{a}*{b}</calc>"}
    )
    turns = (
        [
            call,
            {"role": "tool", "content": answer},
            {"role": "assistant", "content": answer},
        ]
        if tool
        else [{"role": "assistant", "content": answer}]
    )
    ids = task_prompt_ids(tok, prompt, fmt)
    labels = [-100] * len(ids)
    messages = [user]
    tools = [CALC] if fmt == "hermes" else None
    for m in turns:
        messages.append(m)
        full = tok.apply_chat_template(
            messages, tools=tools, tokenize=True, return_dict=False, add_generation_prompt=m["role"] == "tool"
        )
        new = full[len(ids) :]
        if m["role"] == "assistant":
            new = new[:-1]  # the template's "\n" after <|im_end|> is the next turn's separator
            labels += new
        else:
            labels += [-100] * len(new)
        ids += new
    return tuple(ids), tuple(labels)


def batch(
    tok, rows: list[dict], rng: random.Random, tool_fraction: float, fmt: str = "calc"
) -> list[tuple[torch.Tensor, ...]]:
    """One step's conversations, a tool conversation with probability ``tool_fraction``, as
    padded (ids, attention mask, labels) per kind: a tool conversation is about three times as
    long as a direct one, and padding both to the longest spent half of a step on padding."""
    kinds = [rng.random() < tool_fraction for _ in rows]
    convs = [conversation(tok, r, tool, fmt) for r, tool in zip(rows, kinds)]
    return [
        pad(tok, group)
        for group in ([c for c, t in zip(convs, kinds) if t], [c for c, t in zip(convs, kinds) if not t])
        if group
    ]


def sft_loss(model, parts: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
    """The mean cross-entropy over every labelled token of the step, whichever part holds it:
    each part's sum over its tokens, divided by the step's count (``num_items_in_batch``)."""
    labelled = sum(int((lab[:, 1:] != -100).sum()) for _, _, lab in parts)
    return sum(
        model(input_ids=ids, attention_mask=att, labels=lab, num_items_in_batch=labelled).loss
        for ids, att, lab in parts
    )


@torch.no_grad()
def measure(model, tok, rows: list[dict], fmt: str = "calc") -> dict[str, float]:
    """Tool-call rate of sampled first turns, copy accuracy of tool conversations (greedy, the
    tool turn given), greedy accuracy without the tool."""
    model.eval()
    enc = tok.pad(
        {"input_ids": [task_prompt_ids(tok, r["prompt"], fmt) for r in rows]}, padding=True, return_tensors="pt"
    )
    gen = dict(
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, max_new_tokens=64 if fmt == "hermes" else 24
    )
    mark = "<tool_call>" if fmt == "hermes" else "<calc>"
    sampled = model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, **gen)
    calls = sum(mark in t for t in tok.batch_decode(sampled[:, enc["input_ids"].shape[1] :], skip_special_tokens=True))
    greedy = model.generate(**enc, do_sample=False, **gen)
    direct = sum(
        t.strip() == r["answer"]
        for t, r in zip(tok.batch_decode(greedy[:, enc["input_ids"].shape[1] :], skip_special_tokens=True), rows)
    )
    copies = 0
    for r in rows:
        ids, _ = conversation(tok, r, True, fmt)
        cut = len(ids) - len(tok.encode(r["answer"])) - 1  # up to the final assistant turn
        out = model.generate(input_ids=torch.tensor([ids[:cut]]), do_sample=False, **gen)
        copies += tok.decode(out[0, cut:], skip_special_tokens=True).strip() == r["answer"]
    model.train()
    return {
        "tool_call_rate": calls / len(rows),
        "copy_accuracy": copies / len(rows),
        "greedy_accuracy_without_tool": direct / len(rows),
    }


def sft_steps(model, tok, train: list[dict], args) -> Iterator[float]:
    """The warm start's supervised steps, endless, yielding each step's loss: ``--batch-size``
    rows drawn with ``random.Random(--seed)`` (which also picks each row's kind), AdamW at
    ``--lr``, gradients clipped to norm 1. Seeded: ``tools/tiny_weights.py`` checks the committed
    weights' first losses against these."""
    rng = random.Random(args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    while True:
        loss = sft_loss(model, batch(tok, rng.sample(train, args.batch_size), rng, args.tool_fraction, args.format))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        yield loss.item()


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-train", type=int, default=4000)
    ap.add_argument("--n-test", type=int, default=500)
    ap.add_argument("--tool-fraction", type=float, default=0.25)
    ap.add_argument(
        "--format", choices=("calc", "hermes"), default="calc", help="How the call is written (module docstring)."
    )
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument(
        "--weights",
        type=Path,
        help="Take the warm-started weights from this file (tools/tiny_weights/) instead of training.",
    )
    return ap


def main() -> None:
    args = parser().parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    tok = tokenizer_for(args.format)
    model = build_model(tok, args.seed)
    train, test = make_task(args.seed, args.n_train, args.n_test)
    steps, t0 = args.steps, time.time()
    if args.weights:
        model, recorded = load_weights(model, args.weights)
        steps = recorded["sft_steps"]
    else:
        for step, loss in zip(range(1, args.steps + 1), sft_steps(model, tok, train, args)):
            if step % 100 == 0:
                print(f"[make_tool_model] step {step:5d} loss {loss:.4f} ({time.time() - t0:.0f}s)", flush=True)
    report = {"seed": args.seed, "sft_steps": steps, "tool_fraction": args.tool_fraction} | measure(
        model, tok, test[:200], args.format
    )
    report |= weights_origin(args.weights)
    args.out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        eos_token_id=[tok.eos_token_id, tok.pad_token_id], pad_token_id=tok.pad_token_id
    )
    model.save_pretrained(args.out, safe_serialization=True)
    tok.save_pretrained(args.out)
    for name, rows in (("train", train), ("test", test)):
        with open(args.out / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    (args.out / "warmstart.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"[make_tool_model] wrote {args.out}: {report}", flush=True)


if __name__ == "__main__":
    main()
