"""What the dock stores for this recipe, declared without torch: each column's element type,
whether it is ragged (one 1-D sequence per sample) or one scalar per sample, and the stage (or
the data loader, ``"data"``) that writes it. The dock turns these into its specs
(``dock.columns.specs_of``); it knows nothing of RL.

Token ids are int32 (the paper's B = 4 bytes), masks and routes uint8, per-token values float32.
"""

from __future__ import annotations

from dataclasses import dataclass

from spmd_rl.recipe.graph import COLUMNS, DATA_COLUMNS, PARTIAL_COLUMNS, PREFIX_EXTRA, Stage

DTYPES = {
    "prompt_ids": "int32",
    "answer": "uint8",
    "response_ids": "int32",
    "response_length": "int32",
    "response_version": "int32",
    "prompt_row": "int32",
    "prefix_ids": "int32",
    "prefix_version": "int32",
    "prefix_done": "int32",
    "rollout_routes": "uint8",
    "prefix_routes": "uint8",
    "response_mask": "uint8",
    "prefix_mask": "uint8",
    "agent_prompt_ids": "int32",
}
"""Element types other than float32, by column."""


@dataclass(frozen=True)
class ColumnDecl:
    name: str
    dtype: str
    """A torch dtype's name (``torch.<dtype>``)."""
    ragged: bool
    writer: str


def column_decls(stages: list[Stage]) -> dict[str, ColumnDecl]:
    """Every column written by ``stages`` and by the data loader (``DATA_COLUMNS``, and the
    ``PARTIAL_COLUMNS`` the rollout reads under partial rollout)."""
    writers = dict.fromkeys(
        DATA_COLUMNS + tuple(c for c in PARTIAL_COLUMNS + PREFIX_EXTRA if stages and c in stages[0].inputs), "data"
    )
    for s in stages:
        writers.update({c: s.name for c in s.outputs})
    return {
        name: ColumnDecl(name, DTYPES.get(name, "float32"), COLUMNS[name] != "scalar", writer)
        for name, writer in writers.items()
    }
