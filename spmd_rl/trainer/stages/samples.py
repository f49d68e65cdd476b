"""Sample helpers the stages share: the data loader's put of the prompts (the ``data`` writer of
``recipe.graph.DATA_COLUMNS``), text as a column, ragged columns and sequence batches."""

from __future__ import annotations

import torch
import torch.distributed as dist

from spmd_rl.engines.training.logprobs import SeqBatch, build_batch
from spmd_rl.trainer.context import Run
from spmd_rl.trainer.stages.registry import StageView


def encode_text(text: str) -> torch.Tensor:
    """A string as a dock column value: its UTF-8 bytes."""
    return (
        torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)
        if text
        else torch.zeros(0, dtype=torch.uint8)
    )


def decode_text(value: torch.Tensor) -> str:
    return value.numpy().tobytes().decode("utf-8")


def ragged(values: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
    """Row k of a padded [B, R] tensor cut to its length, as float32."""
    return [values[k, :n].contiguous().float() for k, n in enumerate(lengths)]


def padded(columns: list[torch.Tensor], width: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Ragged per-token columns as a right-padded [B, width] tensor (0 past each length)."""
    out = torch.zeros(len(columns), width, dtype=dtype)
    for k, v in enumerate(columns):
        out[k, : v.numel()] = v
    return out


def seq_batch(view: StageView, batch) -> SeqBatch:
    """The stage's samples as a sequence batch, carrying the ``rollout_routes`` column when the
    stage reads it (routing replay and the router metrics) and masking inserted tokens when it
    reads ``response_mask`` (multi-turn rollouts); an agent's samples start from their own
    prompts (``agent_prompt_ids``)."""
    routes = batch.columns.get("rollout_routes")
    shape = None if routes is None else (view.arch.num_layers, view.arch.experts_per_token)
    return build_batch(
        batch.columns["agent_prompt_ids"] if "agent_prompt_ids" in batch.columns else batch.columns["prompt_ids"],
        batch.columns["response_ids"],
        view.tokenizer.pad_token_id,
        routes,
        shape,
        batch.columns.get("response_mask"),
    )


def put_prompts(run: Run, it: int, prompt_positions: list[int], first_group: int = 0) -> list[int]:
    """Generation DP group g writes the prompts (and reference answers) of its slice of the
    round's batch, prompt p (global group id q = first_group + p) repeated N times under
    indices q * N + k. Collective over this side's ranks: returns the dataset row of each prompt
    p as its putter wrote it (the prompt ledger's observed ``put``)."""
    lay, n = run.lay.gen, run.cfg.rollout.n
    g, tp_rank = lay.coords(run.peer.rank)
    per = len(prompt_positions) // lay.dp
    mine = range(g * per, (g + 1) * per)
    put = torch.zeros(len(prompt_positions), dtype=torch.int64)  # row + 1 of each prompt, filled by its putter
    if tp_rank == 0:
        rows = [prompt_positions[p] for p in mine for _ in range(n)]
        cols = prompt_columns(run, rows)
        run.dock.put("data", it, cols, [(first_group + p) * n + k for p in mine for k in range(n)])
        put[g * per : (g + 1) * per] = cols["prompt_row"][::n].long() + 1
    dist.all_reduce(put, group=run.sides.group)
    return [int(r) - 1 for r in put]


def prompt_columns(run: Run, rows: list[int]) -> dict[str, list[torch.Tensor] | torch.Tensor]:
    """The data loader's ``prompt_ids``, ``answer`` and ``prompt_row`` of one sample per dataset row."""
    return {
        "prompt_ids": [torch.tensor(run.prompts.prompt_ids[r], dtype=torch.int32) for r in rows],
        "answer": [encode_text(run.prompts.answers[r]) for r in rows],
        "prompt_row": torch.tensor(rows, dtype=torch.int32),
    }
