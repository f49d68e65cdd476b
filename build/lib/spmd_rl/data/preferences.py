"""Preference datasets for DPO: rows of (prompt, chosen, rejected) text, the columns named by
``data.prompt_column`` / ``data.chosen_column`` / ``data.rejected_column``.

A response is the tokenizer's encoding of its text followed by the end-of-turn token (the
tokenizer's ``eos_token``: what ends a sampled response), so a pair's log-probs are those of
the whole reply the policy would have to write. Bad rows (a missing or empty column, a prompt
longer than ``data.max_prompt_length``, a response longer than ``rollout.max_response_length``,
chosen equal to rejected) are counted and skipped with a warning naming the rows, as prompts are.
"""

from __future__ import annotations

import logging
from pathlib import Path

from spmd_rl.data.prompts import PromptSet, encode_prompts, load_rows

log = logging.getLogger(__name__)


def preferences_for(cfg, tokenizer, path: str | Path) -> PromptSet:
    """A preference file read with the run's ``data`` fields and ``rollout.max_response_length``."""
    d = cfg.data
    return load_preferences(
        path,
        tokenizer,
        d.prompt_column,
        d.chosen_column,
        d.rejected_column,
        d.max_prompt_length,
        cfg.rollout.max_response_length,
        d.apply_chat_template,
    )


def _reason(row: dict, columns: tuple[str, str, str]) -> str | None:
    for c in columns:
        if c not in row or row[c] is None:
            return f"missing column {c!r}"
        if not str(row[c]).strip():
            return f"empty {c!r}"
    return "chosen equals rejected" if str(row[columns[1]]) == str(row[columns[2]]) else None


def load_preferences(
    path: str | Path,
    tokenizer,
    prompt_column: str,
    chosen_column: str,
    rejected_column: str,
    max_prompt_length: int,
    max_response_length: int,
    chat_template: bool = True,
) -> PromptSet:
    """The pairs of a preference file (``PromptSet.pairs``; ``answers`` are empty: no reward
    reads them)."""
    columns = (prompt_column, chosen_column, rejected_column)
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError(f"{tokenizer.name_or_path}: the tokenizer has no eos_token to end a DPO response with")
    out = PromptSet([], [], [], [])
    candidates: list[tuple[int, dict]] = []
    for row_no, row in enumerate(load_rows(path)):
        if (reason := _reason(row, columns)) is not None:
            out.skipped.setdefault(reason, []).append(row_no)
        else:
            candidates.append((row_no, row))
    prompts, chosen, rejected = (
        encode_prompts(tokenizer, [str(row[c]) for _, row in candidates], chat_template and c == prompt_column)
        for c in columns
    )  # one batched tokenizer call per column
    for (row_no, row), ids, good, bad in zip(candidates, prompts, chosen, rejected):
        good, bad = [*good, eos], [*bad, eos]
        longest = max(len(good), len(bad))
        reason = (
            f"prompt of {len(ids)} tokens > data.max_prompt_length={max_prompt_length}"
            if len(ids) > max_prompt_length
            else f"response of {longest} tokens > rollout.max_response_length={max_response_length}"
            if longest > max_response_length
            else None
        )
        if reason is not None:
            out.skipped.setdefault(reason, []).append(row_no)
            continue
        out.prompt_ids.append(ids)
        out.answers.append("")
        out.rows.append(row_no)
        out.texts.append(str(row[prompt_column]))
        out.pairs.append((good, bad))
    for reason, rows in out.skipped.items():
        log.warning("%s: skipped %d row(s) with %s, e.g. row %s", path, len(rows), reason, rows[:5])
    if not out.pairs:
        raise ValueError(
            f"{path}: no usable preference rows (columns {', '.join(columns)}; skipped: "
            f"{', '.join(f'{k}: {len(v)}' for k, v in out.skipped.items())})"
        )
    return out
