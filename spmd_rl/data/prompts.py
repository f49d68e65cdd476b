"""Prompt datasets: jsonl or parquet files (``data.files``), their fields addressed by dotted
paths (``data.rows``), a prompt as a string or chat messages, the chat template, tokenisation.

Rows with a missing prompt or answer, an empty prompt, or a prompt longer than
``data.max_prompt_length`` tokens are counted and skipped with a warning naming the file and
row; a field of the wrong shape (a message without a role, an object where text is expected)
stops the load with ``BadRow`` naming the file, row and field."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spmd_rl.data.files import read_jsonl, read_parquet
from spmd_rl.data.rows import MISSING, field_at, messages_at, plain_text, text_at

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PromptFormat:
    """How a row becomes a prompt and what travels with it (the ``data`` fields of these names)."""

    prompt: str = "prompt"
    """Dotted path of the prompt: a string, or a list of {role, content} messages."""
    answer: str = "answer"
    """Dotted path of the reference answer handed to the reward (verl: ``reward_model.ground_truth``)."""
    data_source: str = "data_source"
    extra_info: str = "extra_info"
    system_prompt: str | None = None
    chat_template: bool = True
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of ``apply_chat_template`` (Qwen3's ``enable_thinking``)."""

    @classmethod
    def of(cls, data) -> "PromptFormat":
        """The format the run's ``data`` section describes."""
        return cls(
            data.prompt_column,
            data.answer_column,
            data.data_source_column,
            data.extra_info_column,
            data.system_prompt,
            data.apply_chat_template,
            dict(data.chat_template_kwargs),
        )


@dataclass
class PromptSet:
    prompt_ids: list[list[int]]
    answers: list[str]
    rows: list[int]
    """Row number of each kept prompt, counted over the files in order."""
    texts: list[str] = field(default_factory=list)
    """The last user message of each kept prompt (a multi-turn environment starts from it)."""
    pairs: list[tuple[list[int], list[int]]] = field(default_factory=list)
    """Preference data (``data.preferences``): the (chosen, rejected) response token ids of each prompt."""
    skipped: dict[str, list[int]] = field(default_factory=dict)
    messages: list[list[dict[str, str]]] = field(default_factory=list)
    """The chat messages of each kept prompt, the system prompt included."""
    sources: list[str] = field(default_factory=list)
    """Each kept prompt's ``data_source`` ("" where the row has none)."""
    extras: list[dict] = field(default_factory=list)
    """Each kept prompt's ``extra_info`` ({} where the row has none)."""

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def info(self, position: int) -> dict[str, Any]:
        """What a reward reads of prompt ``position`` besides the answer (``rewards``): its
        messages, ``data_source`` and ``extra_info``."""
        return {
            "prompt": self.messages[position] if self.messages else self.texts[position],
            "data_source": self.sources[position] if self.sources else "",
            "extra_info": self.extras[position] if self.extras else {},
        }

    def environment_row(self, position: int) -> dict:
        """What a multi-turn environment starts from: prompt ``position``'s text, answer and row info."""
        return (
            {"prompt": self.texts[position], "answer": self.answers[position]}
            | self.info(position)
            | {
                "prompt": self.texts[position],
                "messages": self.info(position)["prompt"],
            }
        )


def load_rows(path: str | Path) -> list[dict]:
    """Rows of a .jsonl or .parquet file; ``BadFile`` (a ValueError) names the file and line."""
    return read_parquet(path) if str(path).endswith(".parquet") else read_jsonl(path)


def paths_of(paths: str | Path | list) -> list[str]:
    """``data.train_path`` as a list: one file or several, read in order."""
    return [str(p) for p in paths] if isinstance(paths, (list, tuple)) else [str(paths)]


def test_sets(test_path) -> dict[str, list[str]]:
    """``data.test_path`` as named sets: a file or a list of files is the set ``test``; a mapping
    names its sets (in its order)."""
    if not test_path:
        return {}
    if isinstance(test_path, dict):
        return {str(name): paths_of(p) for name, p in test_path.items()}
    return {"test": paths_of(test_path)}


def render_prompts(tokenizer, conversations: list[list[dict[str, str]]], fmt: PromptFormat) -> list[str]:
    """Each conversation rendered by the chat template with the generation prompt
    (``fmt.template_kwargs`` passed through), or with ``chat_template: false`` its one user
    message as bare text."""
    if not fmt.chat_template:
        return [m[0]["content"] for m in conversations]
    return [
        tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False, **fmt.template_kwargs)
        for m in conversations
    ]


def encode_prompts(tokenizer, texts: list[str], chat_template: bool) -> list[list[int]]:
    """Token ids of each prompt text: the chat template rendered as a user turn with the generation
    prompt (``apply_chat_template(..., tokenize=True)``, which tokenizes the rendered text
    without special tokens), or the bare text. One batched tokenizer call for all of them."""
    conversations = [[{"role": "user", "content": t}] for t in texts]
    return _tokenize(tokenizer, render_prompts(tokenizer, conversations, PromptFormat(chat_template=chat_template)))


def _tokenize(tokenizer, texts: list[str]) -> list[list[int]]:
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]] if texts else []


def load_tokenizer(cfg):
    """The tokenizer of a run: ``model.tokenizer_path``, else the model folder. One without a
    pad token (Llama 3's) pads with its EOS token: padding is masked everywhere it is read."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.path)
    return with_pad_token(tok)


def with_pad_token(tok):
    """``tok`` with a pad token: its own, else its EOS token (logged); ValueError with neither."""
    if tok.pad_token_id is None:
        if tok.eos_token is None:
            raise ValueError(f"{tok.name_or_path}: the tokenizer has neither a pad nor an EOS token; give it one")
        tok.pad_token = tok.eos_token
        log.info("%s has no pad token: padding with its EOS token %r", tok.name_or_path, tok.eos_token)
    return tok


def prompts_for(cfg, tokenizer, paths) -> "PromptSet":
    """The prompt file(s) ``paths`` read with the run's ``data`` fields."""
    return load_prompts(paths, tokenizer, PromptFormat.of(cfg.data), cfg.data.max_prompt_length)


def load_prompts(paths, tokenizer, fmt: PromptFormat, max_prompt_length: int) -> PromptSet:
    """Every usable row of the file(s) ``paths``, in order (module docstring)."""
    out = PromptSet([], [], [], [])
    kept: list[tuple[int, dict, list, str]] = []
    base = 0
    for path in paths_of(paths):
        rows = load_rows(path)
        for k, row in enumerate(rows):
            where = f"{path}: row {k}"
            messages = messages_at(row, fmt.prompt, where, fmt.system_prompt)
            answer = text_at(row, fmt.answer, where)
            reason = None
            if messages is MISSING:
                reason = f"missing field {fmt.prompt!r}"
            elif answer is MISSING:
                reason = f"missing field {fmt.answer!r}"
            elif not any(m["content"].strip() for m in messages if m["role"] == "user"):
                reason = "empty prompt"
            if reason is not None:
                out.skipped.setdefault(reason, []).append(base + k)
                continue
            if not fmt.chat_template:
                plain_text(messages, where, fmt.prompt)
            kept.append((base + k, row, messages, answer))
        base += len(rows)
    encoded = _tokenize(tokenizer, render_prompts(tokenizer, [m for _, _, m, _ in kept], fmt))
    for (row_no, row, messages, answer), ids in zip(kept, encoded):
        if len(ids) > max_prompt_length:
            out.skipped.setdefault(
                f"prompt of {len(ids)} tokens > data.max_prompt_length={max_prompt_length}", []
            ).append(row_no)
            continue
        source, extra = field_at(row, fmt.data_source), field_at(row, fmt.extra_info)
        out.prompt_ids.append(ids)
        out.answers.append(answer)
        out.rows.append(row_no)
        out.texts.append(next(m["content"] for m in reversed(messages) if m["role"] == "user"))
        out.messages.append(messages)
        out.sources.append("" if source is MISSING else str(source))
        out.extras.append(extra if isinstance(extra, dict) else {})
    where = ", ".join(paths_of(paths))
    for reason, rows in out.skipped.items():
        log.warning("%s: skipped %d row(s) with %s, e.g. row %s", where, len(rows), reason, rows[:5])
    if not out.prompt_ids:
        raise ValueError(
            f"{where}: no usable prompt rows (skipped: {', '.join(f'{k}: {len(v)}' for k, v in out.skipped.items())})"
        )
    return out
