"""Read what the ``dump`` fault plan (tests/helpers/faults/sitecustomize.py) saved from a run:
every column a stage put into the dock, by iteration and sample index, and the residency
ledger's rows per rank."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def dump_env(folder: Path) -> dict[str, str]:
    """Extra environment for ``trainer_util.train`` that makes the workers dump into ``folder``."""
    return {"SPMD_RL_TEST_FAULTS": json.dumps({"kind": "dump", "dir": str(folder)})}


def columns(folder: Path) -> dict[int, dict[str, dict[int, torch.Tensor]]]:
    """iteration -> column -> sample index -> value, over every rank's puts. A sample's column
    is written once (the writer rule); a second write would be a bug, so it fails here."""
    out: dict[int, dict[str, dict[int, torch.Tensor]]] = {}
    for f in sorted(folder.glob("put_rank*_*.pt")):
        rec = torch.load(f, weights_only=True)
        for name, values in rec["columns"].items():
            col = out.setdefault(rec["iteration"], {}).setdefault(name, {})
            for k, i in enumerate(rec["indices"]):
                assert i not in col, f"sample {i} of column {name} written twice in iteration {rec['iteration']}"
                col[i] = values[k]
    return out


def ledger(folder: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (folder / f"ledger_rank{rank}.jsonl").read_text().splitlines()]
