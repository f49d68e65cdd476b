"""Checkpoint resolution and pruning on folders alone (no process group): a restarted run
continues from its newest checkpoint, not from the folder it was started from; pruning never
deletes the checkpoint just written nor another lineage's; metrics of redone iterations are
not duplicated."""

from __future__ import annotations

import json
from pathlib import Path

from spmd_rl.trainer.checkpoint import complete_checkpoints, folder_for, origin_of, resume_folder
from spmd_rl.trainer.metrics import truncate_from


def _fake(root: Path, it: int, origin: str | None) -> Path:
    d = folder_for(root, it)
    d.mkdir(parents=True)
    (d / "trainer_state.json").write_text(json.dumps({"iteration": it, "origin": origin}))
    return d


def test_resume_folder_prefers_its_own_newer_lineage(tmp_path):
    root = tmp_path / "ckpt"
    start = _fake(tmp_path / "old", 50, None)
    assert resume_folder(root, str(start)) == start  # first start: the folder
    _fake(root, 100, None)  # another timeline's newer checkpoint: ignored
    assert resume_folder(root, str(start)) == start
    _fake(root, 60, origin_of(str(start)))
    newest = _fake(root, 70, origin_of(str(start)))
    assert resume_folder(root, str(start)) == newest  # a restart continues, it does not roll back
    assert resume_folder(root, "auto") == folder_for(root, 100)
    assert resume_folder(root, "never") is None


def test_pruning_rule_keeps_what_was_just_written(tmp_path, monkeypatch):
    """``save``'s pruning, run by rank 0 after the rename (the process-group parts stubbed)."""
    import spmd_rl.trainer.checkpoint as ck

    class Engine:
        def save(self, folder):
            Path(folder).mkdir(exist_ok=True)

    monkeypatch.setattr(ck.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(ck.dist, "barrier", lambda group=None: None)
    root = tmp_path / "ckpt"
    other = _fake(root, 200, None)  # a newer checkpoint of another lineage
    origin = origin_of(str(tmp_path / "start"))
    for it in (10, 20, 30):
        written = ck.save(root, it, {"actor": Engine()}, {"iteration": it, "origin": origin}, keep=1)
        assert written.is_dir()  # keep=1 used to delete the folder just written when a newer name existed
    assert complete_checkpoints(root) == [folder_for(root, 30), other]


def test_metrics_of_redone_iterations_are_dropped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"iteration": i}) + "\n" for i in range(5)) + '{"iteration": 5, "lo')
    truncate_from(path, 3)
    assert [json.loads(x)["iteration"] for x in path.read_text().splitlines()] == [0, 1, 2]
    assert (tmp_path / "metrics.jsonl.torn").read_text().startswith('{"iteration": 5')
