"""Atomic checkpoints in a directory all nodes share.

``<dir>/iter_000012/`` holds the actor's DCP shards (params, optimizer, LR schedule), PPO's
critic in ``critic/`` (the same), and ``trainer_state.json`` (iteration, sampler position, RNG, base model path). Every
rank writes its DCP shards into ``iter_000012.tmp/``; after a barrier rank 0 (separated placement: the
training leader, ``distributed.sides``) writes the trainer state and renames the folder, so a folder without ``.tmp`` is
always complete.

Lineage. A run started with ``checkpoint.resume=<folder>`` records that folder as the
``origin`` of every checkpoint it writes. Resolution (:func:`resume_folder`): ``auto`` takes
the latest complete checkpoint; ``<folder>`` takes the latest checkpoint of its own lineage
(origin == folder) newer than the folder, else the folder itself; so a torchrun restart after
a failure continues from the newest checkpoint instead of rolling back to the folder, while a
fresh start from an older folder ignores the other timeline's newer checkpoints.

A lineage also has an id, ``lineage`` in every checkpoint's trainer state (:func:`lineage_id`):
minted by a fresh start or a start from another lineage's folder, kept by every restart that
resumes its own checkpoints. It names the run's W&B run, so a restart continues that run and a
new run that reuses the job name gets its own.

Pruning after a save keeps the ``keep`` newest checkpoints of the run's own lineage; it never
deletes the checkpoint just written nor any checkpoint of another lineage.
"""

from __future__ import annotations

import base64
import json
import re
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from spmd_rl.engines.training.safe_dcp import read_full_state

_NAME = re.compile(r"^iter_(\d{6})$")
SAVED_ROLES = ("actor", "critic")
"""The roles with trained state; the frozen ones (reference, reward model) are their folders."""


def role_folder(folder: str | Path, role: str) -> Path:
    """Where ``role``'s DCP shards live in a checkpoint: the actor at the top (so a checkpoint
    stays an actor checkpoint for export and eval), every other role in a sub-folder."""
    return Path(folder) if role == "actor" else Path(folder) / role


def folder_for(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:06d}"


def complete_checkpoints(root: str | Path) -> list[Path]:
    p = Path(root)
    if not p.is_dir():
        return []
    found = [d for d in p.iterdir() if d.is_dir() and _NAME.match(d.name) and (d / "trainer_state.json").is_file()]
    return sorted(found, key=lambda d: d.name)


def latest(root: str | Path) -> Path | None:
    found = complete_checkpoints(root)
    return found[-1] if found else None


def rng_state() -> str:
    return base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()


def set_rng_state(text: str) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8))


def origin_of(resume: str) -> str | None:
    """The lineage a run with this ``checkpoint.resume`` writes: the resolved folder, or None."""
    return None if resume in ("auto", "never") else str(Path(resume).resolve())


def lineage_id(state: dict | None, resume: str) -> str:
    """The id of the lineage a run writes (module docstring): ``state``'s (the resumed
    checkpoint's) where that checkpoint belongs to it (its origin is the one this
    ``checkpoint.resume`` writes), else 12 new random hex digits."""
    if state is not None and state.get("lineage") and state.get("origin") == origin_of(resume):
        return state["lineage"]
    return secrets.token_hex(6)


def _lineage(root: str | Path, origin: str | None) -> list[Path]:
    return [c for c in complete_checkpoints(root) if read_state(c).get("origin") == origin]


def resume_folder(root: str | Path, resume: str) -> Path | None:
    """The checkpoint a (re)starting run loads (module docstring)."""
    if resume == "never":
        return None
    if resume == "auto":
        return latest(root)
    start = Path(resume)
    newer = [
        c
        for c in _lineage(root, origin_of(resume))
        if int(read_state(c)["iteration"]) > int(read_state(start)["iteration"])
    ]
    return newer[-1] if newer else start


def save(
    root: str | Path,
    iteration: int,
    roles: dict,
    trainer_state: dict,
    keep: int,
    before_commit: Callable[[], None] | None = None,
    group=None,
    leader: int = 0,
) -> Path:
    """Write ``iter_NNNNNN`` atomically with the state of every role of ``SAVED_ROLES`` in
    ``roles``, then prune (module docstring). ``trainer_state`` carries ``origin`` (the lineage).
    ``before_commit`` runs on every rank after its writes and before the folder becomes the
    newest complete checkpoint: what must be on disk whenever that checkpoint is (a resumed
    run does not redo its iterations). Collective over ``group``, the training side's ranks
    (``Run.sides``), whose rank ``leader`` writes the folder and the trainer state."""
    final = folder_for(root, iteration)
    tmp = final.with_name(final.name + ".tmp")
    leader = dist.get_rank() == leader
    if leader:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier(group=group)
    for role in SAVED_ROLES:
        if role in roles:
            roles[role].save(role_folder(tmp, role), group)
    if before_commit is not None:
        before_commit()
    dist.barrier(group=group)
    if leader:
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in _lineage(root, trainer_state.get("origin"))[:-keep]:
            if old.resolve() != final.resolve():
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier(group=group)
    return final


def read_state(folder: str | Path) -> dict:
    return json.loads((Path(folder) / "trainer_state.json").read_text())


def model_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """The actor's full (unsharded) weights of a checkpoint, read in one process, without
    unpickling anything but DCP metadata classes (``safe_dcp``)."""
    return read_full_state(folder)["model"]
