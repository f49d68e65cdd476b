"""Checkpoints are loaded without unpickling arbitrary objects: a tampered ``.metadata`` or a
tampered non-tensor item is refused before any code of it runs; a real checkpoint loads."""

from __future__ import annotations

import os
import pickle
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from spmd_rl.engines.training.safe_dcp import BadCheckpoint, read_full_state
from spmd_rl.trainer.checkpoint import model_weights


class Payload:
    """Unpickling this runs ``os.system`` (what a hostile checkpoint would do)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _save(folder, state):
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)


def test_real_checkpoint_round_trip(tmp_path):
    state = {
        "model": {"w": torch.arange(6.0).reshape(2, 3)},
        "scheduler": {"last_epoch": 3, "base_lrs": [1e-4]},
        "steps": 7,
    }
    _save(tmp_path / "ok", state)
    got = read_full_state(tmp_path / "ok")
    assert (
        torch.equal(got["model"]["w"], state["model"]["w"])
        and got["scheduler"] == state["scheduler"]
        and got["steps"] == 7
    )
    assert torch.equal(model_weights(tmp_path / "ok")["w"], state["model"]["w"])


def test_tampered_metadata_is_refused_before_it_runs(tmp_path):
    folder = tmp_path / "evil-meta"
    _save(folder, {"model": {"w": torch.ones(2)}})
    marker = tmp_path / "pwned-meta"
    (folder / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(BadCheckpoint, match="posix.system|os.system|refusing to unpickle"):
        model_weights(folder)
    assert not marker.exists()


def test_tampered_non_tensor_item_is_refused_before_it_runs(tmp_path):
    marker = tmp_path / "pwned-item"
    folder = tmp_path / "evil-item"
    _save(folder, {"model": {"w": torch.ones(2)}, "steps": Payload(marker)})  # DCP stores it as pickled bytes
    assert not marker.exists()
    with pytest.raises(BadCheckpoint, match="non-tensor checkpoint item"):
        read_full_state(folder)
    assert not marker.exists()
    shutil.rmtree(folder)


def test_cli_export_refuses_a_tampered_checkpoint(tmp_path):
    import json

    from typer.testing import CliRunner

    from spmd_rl.cli import app

    folder = tmp_path / "iter_000001"
    _save(folder, {"model": {"w": torch.ones(2)}})
    (folder / "trainer_state.json").write_text(json.dumps({"iteration": 1, "model_path": "x", "tokenizer_path": "x"}))
    marker = tmp_path / "pwned-cli"
    (folder / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    res = CliRunner().invoke(app, ["export", str(folder), "--out", str(tmp_path / "hf")])
    assert res.exit_code == 2 and "refusing to unpickle" in res.output and not marker.exists()
