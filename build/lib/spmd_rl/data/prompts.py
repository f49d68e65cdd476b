"""Prompt datasets: jsonl or parquet (``data.files``), column mapping, chat template,
tokenisation. Bad rows (missing column, empty prompt, prompt longer than
``data.max_prompt_length`` tokens) are counted and skipped with a warning naming the row."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from spmd_rl.data.files import read_jsonl, read_parquet

log = logging.getLogger(__name__)


@dataclass
class PromptSet:
    prompt_ids: list[list[int]]
    answers: list[str]
    rows: list[int]
    """Row number in the file of each kept prompt."""
    texts: list[str] = field(default_factory=list)
    """The prompt text of each kept prompt (a multi-turn environment starts from it)."""
    pairs: list[tuple[list[int], list[int]]] = field(default_factory=list)
    """Preference data (``data.preferences``): the (chosen, rejected) response token ids of each prompt."""
    skipped: dict[str, list[int]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def environment_row(self, position: int) -> dict:
        """What a multi-turn environment starts from: prompt ``position``'s text and answer."""
        return {"prompt": self.texts[position], "answer": self.answers[position]}


def load_rows(path: str | Path) -> list[dict]:
    """Rows of a .jsonl or .parquet file; ``BadFile`` (a ValueError) names the file and line."""
    return read_parquet(path) if str(path).endswith(".parquet") else read_jsonl(path)


def encode_prompts(tokenizer, texts: list[str], chat_template: bool) -> list[list[int]]:
    """Token ids of each prompt: the chat template rendered as a user turn with the generation
    prompt (``apply_chat_template(..., tokenize=True)``, which tokenizes the rendered text
    without special tokens), or the bare text. One batched tokenizer call for all of them."""
    if chat_template:
        texts = [
            tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
            for t in texts
        ]
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]] if texts else []


def load_tokenizer(cfg):
    """The tokenizer of a run: ``model.tokenizer_path``, else the model folder."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.path)


def prompts_for(cfg, tokenizer, path: str | Path) -> "PromptSet":
    """A prompt file read with the run's ``data`` fields (columns, chat template, max length)."""
    d = cfg.data
    return load_prompts(path, tokenizer, d.prompt_column, d.answer_column, d.max_prompt_length, d.apply_chat_template)


def load_prompts(
    path: str | Path,
    tokenizer,
    prompt_column: str,
    answer_column: str,
    max_prompt_length: int,
    chat_template: bool = True,
) -> PromptSet:
    out = PromptSet([], [], [], [])
    candidates: list[tuple[int, dict]] = []
    for row_no, row in enumerate(load_rows(path)):
        reason = None
        if prompt_column not in row or row[prompt_column] is None:
            reason = f"missing column {prompt_column!r}"
        elif answer_column not in row or row[answer_column] is None:
            reason = f"missing column {answer_column!r}"
        elif not str(row[prompt_column]).strip():
            reason = "empty prompt"
        if reason is not None:
            out.skipped.setdefault(reason, []).append(row_no)
        else:
            candidates.append((row_no, row))
    encoded = encode_prompts(tokenizer, [str(row[prompt_column]) for _, row in candidates], chat_template)
    for (row_no, row), ids in zip(candidates, encoded):
        if len(ids) > max_prompt_length:
            out.skipped.setdefault(
                f"prompt of {len(ids)} tokens > data.max_prompt_length={max_prompt_length}", []
            ).append(row_no)
            continue
        out.prompt_ids.append(ids)
        out.answers.append(str(row[answer_column]))
        out.rows.append(row_no)
        out.texts.append(str(row[prompt_column]))
    for reason, rows in out.skipped.items():
        log.warning("%s: skipped %d row(s) with %s, e.g. row %s", path, len(rows), reason, rows[:5])
    if not out.prompt_ids:
        raise ValueError(
            f"{path}: no usable prompt rows (skipped: {', '.join(f'{k}: {len(v)}' for k, v in out.skipped.items())})"
        )
    return out
