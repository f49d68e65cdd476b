"""Model and file rules: the model folder and its architecture against the layouts, the data
files, and the reward (``model.*``, ``data.*_path``, ``reward.*``). Paths are resolved against
the current directory."""

from __future__ import annotations

import json
import re
from pathlib import Path
from urllib.parse import urlparse

from spmd_rl.catalog import findable
from spmd_rl.config.errors import Violation
from spmd_rl.config.layout import Layouts
from spmd_rl.config.model_arch import SUPPORTED_TYPES, ModelArch
from spmd_rl.config.schema import Config
from spmd_rl.data.files import check_safetensors, sniff_dataset
from spmd_rl.data.prompts import paths_of, test_sets
from spmd_rl.rewards.registry import RULES

_SET_NAME = re.compile(r"[A-Za-z0-9_.-]+")
"""A held-out set's name: it is part of its metric keys (``eval/<set>/...``)."""


def check_model(cfg: Config, lay: Layouts) -> list[Violation]:
    """The model folder reads as a supported architecture that both TP sizes split, with room
    for the longest sample, intact weights and the tokenizer it names."""
    folder = Path(cfg.model.path)
    cfg_json = folder / "config.json"
    if not cfg_json.is_file():
        problem = "folder not found" if not folder.is_dir() else "has no config.json"
        return [
            Violation(
                "model.path",
                cfg.model.path,
                problem,
                "point it at a local HF model folder (build the tiny one with tools/make_tiny_model.py)",
            )
        ]
    try:
        arch = ModelArch.from_folder(folder)
    except (KeyError, ValueError) as exc:
        return [
            Violation(
                "model.path",
                cfg.model.path,
                f"config.json lacks or mangles {exc}",
                "use a Qwen2/Qwen3/Llama/Qwen3-MoE config.json",
            )
        ]
    return check_model_shape(cfg, lay, arch) + check_model_files(cfg, arch)


def check_model_shape(cfg: Config, lay: Layouts, arch: ModelArch) -> list[Violation]:
    out: list[Violation] = []
    if arch.model_type not in SUPPORTED_TYPES:
        out.append(
            Violation(
                "model.path",
                cfg.model.path,
                f"model_type {arch.model_type!r} is not supported",
                f"use one of {', '.join(SUPPORTED_TYPES)}",
            )
        )
    for name, tp in (("train", lay.train.tp), ("gen", lay.gen.tp)):
        counts = [
            ("num_attention_heads", arch.num_heads),
            ("num_key_value_heads", arch.num_kv_heads),
            ("intermediate_size", arch.intermediate_size),
        ]
        for what, count in counts + ([("moe_intermediate_size", arch.moe_intermediate_size)] if arch.is_moe else []):
            if count % tp:
                out.append(
                    Violation(
                        f"parallel.{name}.tp",
                        tp,
                        f"does not divide the model's {what}={count}",
                        f"use a TP size dividing {count}",
                    )
                )
    return out


def check_model_files(cfg: Config, arch: ModelArch) -> list[Violation]:
    out: list[Violation] = []
    folder = Path(cfg.model.path)
    total = cfg.data.max_prompt_length + cfg.rollout.max_response_length
    if arch.max_positions and total > arch.max_positions:
        out.append(
            Violation(
                "rollout.max_response_length",
                cfg.rollout.max_response_length,
                f"max_prompt_length + max_response_length = {total} exceeds the model's "
                f"max_position_embeddings={arch.max_positions}",
                f"keep the sum <= {arch.max_positions}",
            )
        )
    for weights in sorted(folder.glob("*.safetensors")):
        if (problem := check_safetensors(weights)) is not None:
            out.append(
                Violation(
                    "model.path",
                    cfg.model.path,
                    f"{weights.name}: {problem}",
                    "copy the model folder again or rebuild it",
                )
            )
    tok = Path(cfg.model.tokenizer_path) if cfg.model.tokenizer_path else None
    if tok is not None and not tok.is_dir():
        out.append(
            Violation(
                "model.tokenizer_path",
                cfg.model.tokenizer_path,
                "folder not found",
                "point it at a tokenizer folder or leave it out",
            )
        )
    return out


def check_files(cfg: Config) -> list[Violation]:
    out: list[Violation] = []
    named = [("data.train_path", p) for p in paths_of(cfg.data.train_path)]
    if not named:
        out.append(Violation("data.train_path", [], "names no file", "give a file or a list of them"))
    sets = test_sets(cfg.data.test_path)
    held_out = [
        (f"data.test_path.{name}" if len(sets) > 1 else "data.test_path", p) for name, ps in sets.items() for p in ps
    ]
    for name in sets:
        if not _SET_NAME.fullmatch(name):
            out.append(Violation(f"data.test_path.{name}", name, "not a usable set name", "use letters, digits, _ . -"))
    for field, path in [*named, *held_out]:
        p = Path(path)
        if p.suffix not in (".jsonl", ".parquet"):
            out.append(Violation(field, path, "unsupported file type", "use a .jsonl or .parquet file"))
        elif not p.is_file():
            out.append(
                Violation(
                    field, path, "file not found", "check the path (relative paths start at the current directory)"
                )
            )
        elif (problem := sniff_dataset(p)) is not None:
            out.append(Violation(field, path, problem, f"pass a {p.suffix} file (one JSON object per line for .jsonl)"))
    return out


def check_reward_model(cfg: Config) -> list[Violation]:
    """kind: model needs a one-label sequence classifier over the policy's vocabulary (it
    scores the policy's token ids as they are)."""
    r = cfg.reward
    if r.model_path is None:
        return [
            Violation(
                "reward.model_path",
                None,
                "reward.kind: model needs the reward model's folder",
                "set reward.model_path (tools/make_tiny_reward_model.py --model <policy> writes <policy>/reward_model)",
            )
        ]
    conf = Path(r.model_path) / "config.json"
    try:
        rm = json.loads(conf.read_text())
    except (OSError, ValueError) as exc:
        return [
            Violation(
                "reward.model_path",
                r.model_path,
                f"no readable config.json ({exc.__class__.__name__})",
                "point it at a local HF sequence-classification folder",
            )
        ]
    archs = rm.get("architectures") or []
    if not any(str(a).endswith("ForSequenceClassification") for a in archs):
        return [
            Violation(
                "reward.model_path",
                r.model_path,
                f"architectures {archs} is not a sequence classifier",
                "export the reward model with AutoModelForSequenceClassification",
            )
        ]
    labels = rm.get("num_labels", len(rm.get("id2label") or {}) or 2)
    if labels != 1:
        return [
            Violation(
                "reward.model_path",
                r.model_path,
                f"has {labels} labels; a reward model scores with one",
                "train it with num_labels=1",
            )
        ]
    try:
        policy_vocab = json.loads((Path(cfg.model.path) / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError):
        return []  # model.path's own check reports it
    if rm.get("vocab_size") != policy_vocab:
        return [
            Violation(
                "reward.model_path",
                r.model_path,
                f"vocab_size {rm.get('vocab_size')} differs from the policy's {policy_vocab}",
                "use a reward model with the policy's tokenizer",
            )
        ]
    return []


def check_remote(cfg: Config) -> list[Violation]:
    """``reward.url``: an http(s) URL exactly when ``reward.kind: remote``."""
    r = cfg.reward
    if r.kind != "remote":
        fix = "remove it or set reward.kind: remote"
        return [] if r.url is None else [Violation("reward.url", r.url, "only read with reward.kind: remote", fix)]
    parsed = urlparse(r.url or "")
    if parsed.scheme in ("http", "https") and parsed.netloc:
        return []
    return [
        Violation(
            "reward.url", r.url, "reward.kind: remote needs the service's http(s) URL", "e.g. http://judge:8000/score"
        )
    ]


def _registered_rule(r) -> list[Violation]:
    """A registered rule's needs: math_verify its package; none of them takes a batch."""
    if r.rule == "math_verify" and not findable("math_verify:parse"):
        return [Violation("reward.rule", r.rule, "the math-verify package is not installed", "pip install math-verify")]
    if r.batched:
        return [
            Violation("reward.batched", True, f"{r.rule} scores one response at a time", "set reward.batched: false")
        ]
    return []


def check_reward(cfg: Config) -> list[Violation]:
    r, out = cfg.reward, []
    if r.kind == "remote":
        return check_remote(cfg)
    out += check_remote(cfg)
    if r.kind == "model":
        out += check_reward_model(cfg)
    else:
        model_only = {"model_path"} if r.model_path is not None else set()
        for field in sorted(model_only | ({"rule_weight", "offload_to_host"} & r.model_fields_set)):
            out.append(
                Violation(
                    f"reward.{field}",
                    getattr(r, field),
                    "only read with reward.kind: model",
                    "remove it or set reward.kind: model",
                )
            )
    if out:
        return out
    if r.rule in RULES:
        return _registered_rule(r)
    if r.format_score != 0:
        return [
            Violation(
                "reward.format_score",
                r.format_score,
                f"a module:function rule ({r.rule}) has no notion of a well-formed answer",
                "return the format reward from your function and set format_score: 0",
            )
        ]
    module, sep, func = r.rule.partition(":")
    if not sep or not module or not func.isidentifier():
        return [
            Violation(
                "reward.rule",
                r.rule,
                "neither a registered rule nor module:function",
                f"use one of {', '.join(RULES)} or my_pkg.rewards:score",
            )
        ]
    if not findable(r.rule):
        return [
            Violation(
                "reward.rule",
                r.rule,
                f"module {module!r} not importable",
                "put it on PYTHONPATH or fix the module name",
            )
        ]
    return []
