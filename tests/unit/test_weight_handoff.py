"""The separated generator's weight handoff (``engines.vllm.handoff``, issue 70 finding 8): the
update's file goes to shared memory when it fits, to ``TMPDIR`` otherwise with one warning, a
killed predecessor's folder is removed, and what is written reads back bit for bit."""

from __future__ import annotations

import logging
import os

import torch
from safetensors.torch import load_file

from spmd_rl.engines.vllm import handoff, weight_file


def test_an_update_goes_to_shared_memory_when_it_fits_and_to_tmpdir_otherwise(tmp_path, monkeypatch, caplog):
    shm, tmp = tmp_path / "shm", tmp_path / "tmp"
    shm.mkdir()
    tmp.mkdir()
    monkeypatch.setattr(handoff.tempfile, "gettempdir", lambda: str(tmp))
    monkeypatch.setenv("RANK", "3")
    first = handoff.Handoff(shm)
    (first.shm_root / "weights.safetensors").parent.mkdir(mode=0o700)
    (first.shm_root / "weights.safetensors").write_bytes(b"left by a killed rank")
    again = handoff.Handoff(shm)  # the restarted rank: same job, same rank, same folder
    assert not again.shm_root.exists()
    meta = [("a", torch.float32, [4, 2]), ("b", torch.bfloat16, [3])]
    tensors = {"a": torch.randn(4, 2), "b": torch.randn(3).bfloat16()}
    path = again.path_for(handoff.update_bytes(meta))
    assert path.parent == again.shm_root and path.parent.parent == shm and oct(path.parent.stat().st_mode)[-3:] == "700"
    weight_file.write(str(path), meta, iter(tensors.items()))
    assert all(torch.equal(load_file(path)[k], v) for k, v in tensors.items())
    with caplog.at_level(logging.WARNING, logger="spmd_rl"):
        big = [again.path_for(2**60), again.path_for(2**60)]
    assert all(p.parent == again.disk_root and p.parent.parent == tmp for p in big)
    assert sum("cannot hold" in r.message for r in caplog.records) == 1
    again.close()
    assert not again.shm_root.exists() and not again.disk_root.exists()
    assert handoff.update_bytes(meta) == 4 * 2 * 4 + 3 * 2 and os.environ["RANK"] == "3"
