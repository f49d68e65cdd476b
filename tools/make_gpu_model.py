#!/usr/bin/env python
"""Build the realistic GPU case of ``configs/gpu_qwen25_1_5b.yaml`` with nothing from a hub:
Qwen2.5-1.5B's architecture (``configs/models/qwen2.5-1.5b``) with random weights, a byte-level
BPE tokenizer of Qwen2.5's size trained here, and prompts of natural lengths.

    # here: the tokenizer and prompts (55 s on a 2-core AMD EPYC, 14 MB)
    python tools/make_gpu_model.py --out assets/gpu-qwen2.5-1.5b
    # on the GPU node: the weights, 3.1 GB in bf16
    python tools/make_gpu_model.py --out assets/gpu-qwen2.5-1.5b --weights --device cuda

Two steps because the weights (1.54 B parameters, 3.1 GB in bf16) cannot travel to an air-gapped
node 64 MiB at a time, while their seed and architecture can: the node builds them in seconds.

- **Tokenizer**: Qwen2's pre-tokenizer (its split pattern, then byte-level), BPE trained on this
  Python's own standard library sources, headers and text files (37.6 MB for CPython 3.11.7,
  files in sorted order), to ``--vocab`` tokens (151,643, Qwen2.5's regular vocabulary: the
  merges reach it, none are padded in; the build fails if they fall short), then Qwen's three
  chat tokens at 151,643-151,645 and its ChatML template. The model's embedding has 151,936
  rows, as Qwen2.5's: the rows past the tokenizer are never sampled by a trained model, but a
  random one samples them, and the rollout engine decodes only ids it gets back.
- **Prompts**: "Read the passage, then answer." + consecutive lines of that corpus + "What is
  a+b?", answer ``a+b`` (``reward.rule: exact_match``; a random model scores 0, so the run
  measures work, not learning). Chat-templated lengths are uniform in [``--min-tokens``,
  ``--max-tokens``] (64-256: natural lengths under PL 256), ``train.jsonl`` and ``test.jsonl``.
- **Weights** (``--weights``): ``Qwen2ForCausalLM`` from the folder's ``config.json``, built on
  ``--device`` in bf16 from ``--seed`` (transformers' own initialisation), saved as safetensors.

``--set key=value`` overrides an architecture field (the tests build a two-layer model that way).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sysconfig
import time
from pathlib import Path

from make_tiny_model import CHAT_TEMPLATE, IM_END, IM_START, PAD  # tools/ is the script's folder

REPO = Path(__file__).resolve().parents[1]
ARCH = REPO / "configs" / "models" / "qwen2.5-1.5b"
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
"""Qwen2's pre-tokenizer split (its tokenizer.json): letters, single digits, punctuation, space runs."""
CORPUS_SUFFIXES = (".py", ".txt", ".html", ".c", ".decTest", ".xml")


def corpus_files(limit_bytes: int | None = None) -> list[Path]:
    """This interpreter's standard library text, sorted (the same files give the same tokenizer)."""
    stdlib, include = Path(sysconfig.get_paths()["stdlib"]), Path(sysconfig.get_paths()["include"])
    files = sorted(p for p in stdlib.rglob("*") if p.suffix in CORPUS_SUFFIXES and "site-packages" not in p.parts)
    files += sorted(include.rglob("*.h"))
    if limit_bytes is not None:
        kept, total = [], 0
        for p in files:
            if total >= limit_bytes:
                break
            kept.append(p)
            total += p.stat().st_size
        files = kept
    return files


def train_tokenizer(files: list[Path], vocab: int):
    """Byte-level BPE with Qwen2's split, exactly ``vocab`` trained tokens, then the chat tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, min_frequency=1, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator((p.read_text(errors="replace") for p in files), trainer)
    if tok.get_vocab_size() != vocab:
        raise SystemExit(f"the corpus gave {tok.get_vocab_size()} tokens, not {vocab}: it has too few distinct words")
    tok.add_special_tokens([PAD, IM_START, IM_END])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=IM_END, pad_token=PAD, chat_template=CHAT_TEMPLATE, padding_side="left"
    )


def corpus_lines(files: list[Path]) -> list[str]:
    lines = []
    for p in files:
        lines += [line for line in p.read_text(errors="replace").splitlines() if line.strip()]
    return lines


def make_prompts(tokenizer, lines: list[str], count: int, lengths: tuple[int, int], seed: int) -> list[dict]:
    """Prompts whose chat-templated length is drawn uniformly from ``lengths`` (inclusive); the
    passage grows line by line while it fits."""
    rng = random.Random(seed)

    def templated(passage: str, question: str) -> tuple[int, str]:
        text = f"Read the passage, then answer.\n\n{passage}\n\n{question}"
        chat = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        return len(tokenizer(chat, add_special_tokens=False).input_ids), text

    rows = []
    while len(rows) < count:
        want = rng.randint(*lengths)
        a, b = rng.randrange(1000), rng.randrange(1000)
        question, start = f"What is {a}+{b}?", rng.randrange(len(lines))
        passage, (n, text) = "", templated("", question)
        for line in lines[start : start + 400]:
            grown = f"{passage}\n{line}" if passage else line
            m, t = templated(grown, question)
            if m > want:
                break
            passage, n, text = grown, m, t
        if lengths[0] <= n <= lengths[1]:
            rows.append({"prompt": text, "answer": str(a + b), "prompt_tokens": n})
    return rows


def architecture(arch: Path, sets: list[str], tokenizer) -> dict:
    cfg = json.loads((arch / "config.json").read_text())
    for item in sets:
        key, _, value = item.partition("=")
        if key not in cfg:
            raise SystemExit(f"--set {item}: {arch / 'config.json'} has no field {key!r}")
        cfg[key] = json.loads(value)
    if len(tokenizer) > cfg["vocab_size"]:
        raise SystemExit(
            f"the tokenizer has {len(tokenizer)} tokens, the architecture's vocab_size {cfg['vocab_size']}"
        )
    cfg |= {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id, "bos_token_id": None}
    return cfg


def build_text_side(args: argparse.Namespace) -> None:
    t0 = time.time()
    limit = int(args.corpus_mib * 2**20) if args.corpus_mib else None
    files = corpus_files(limit)
    digest = hashlib.sha256()
    for p in files:
        digest.update(p.read_bytes())
    tokenizer = train_tokenizer(files, args.vocab)
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(args.out)
    cfg = architecture(args.arch, args.set, tokenizer)
    (args.out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    generation = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    (args.out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    rows = make_prompts(tokenizer, corpus_lines(files), args.train + args.test, (args.min_tokens, args.max_tokens), 0)
    for name, part in (("train", rows[: args.train]), ("test", rows[args.train :])):
        with open(args.out / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps({k: r[k] for k in ("prompt", "answer")}) + "\n" for r in part)
    lengths = sorted(r["prompt_tokens"] for r in rows)
    build = {
        "architecture": str(args.arch.relative_to(REPO)) if args.arch.is_relative_to(REPO) else str(args.arch),
        "sets": args.set,
        "corpus_files": len(files),
        "corpus_sha256": digest.hexdigest(),
        "tokens": len(tokenizer),
        "prompt_tokens": {"min": lengths[0], "median": lengths[len(lengths) // 2], "max": lengths[-1]},
    }
    (args.out / "build.json").write_text(json.dumps(build, indent=2) + "\n")
    print(f"[gpu-model] {args.out}: {len(tokenizer)} tokens from {len(files)} files, {len(rows)} prompts "
          f"({build['prompt_tokens']}) in {time.time() - t0:.0f} s")  # fmt: skip


def build_weights(args: argparse.Namespace) -> None:
    """Random bf16 weights of the folder's ``config.json``, built on ``--device`` from ``--seed``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    t0 = time.time()
    cfg = Qwen2Config(**json.loads((args.out / "config.json").read_text()))
    torch.manual_seed(args.seed)
    with torch.device(args.device):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(args.out, safe_serialization=True)
    n = sum(p.numel() for p in model.parameters())
    print(f"[gpu-model] {args.out}: {n / 1e9:.2f} B parameters, bf16, on {args.device} in {time.time() - t0:.0f} s")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=REPO / "assets" / "gpu-qwen2.5-1.5b")
    p.add_argument("--arch", type=Path, default=ARCH, help="a folder with the architecture's config.json")
    p.add_argument("--set", action="append", default=[], help="override an architecture field: key=json-value")
    p.add_argument("--vocab", type=int, default=151643, help="trained tokens before the three chat tokens")
    p.add_argument("--corpus-mib", type=float, help="train on the first files up to this size (tests)")
    p.add_argument("--train", type=int, default=4096)
    p.add_argument("--test", type=int, default=256)
    p.add_argument("--min-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--weights", action="store_true", help="build the random weights into --out (after the first step)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.weights:
        if not (args.out / "config.json").exists():
            raise SystemExit(f"{args.out}: no config.json; run without --weights first")
        build_weights(args)
    else:
        build_text_side(args)


if __name__ == "__main__":
    main()
