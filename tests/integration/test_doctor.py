"""``spmd-rl doctor`` on this machine: it passes for the quickstart against a real etcd, and
each failing check exits 2 naming the check and its fix: an etcd that does not answer, a
/dev/shm too small for the config (a 1 MiB tmpfs mounted over it in a private mount namespace),
a busy dock port, more host memory than the node has; a version other than the tested one is a
warning, not a failure."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

from typer.testing import CliRunner

from spmd_rl.cli import app
from spmd_rl.launcher import doctor
from tests.conftest import REPO, subprocess_env

QUICK = "configs/quickstart.yaml"


def _doctor(*overrides: str):
    return CliRunner().invoke(app, ["doctor", QUICK, *overrides])


def test_doctor_passes_on_this_machine_with_a_real_etcd(in_repo, tiny_model, etcd):
    res = _doctor(f"metadata.endpoints=[{etcd.endpoint}]")
    assert res.exit_code == 0, res.output
    assert f"ok    etcd: {etcd.endpoint} answers without TLS" in res.output and "9 of 9 checks passed" in res.output


def test_an_etcd_that_does_not_answer_fails_with_the_fix(in_repo, tiny_model):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = _doctor(f"metadata.endpoints=[127.0.0.1:{port}]", "metadata.retry_s=1")
    assert res.exit_code == 2, res.output
    assert f"FAIL  etcd: 127.0.0.1:{port} without TLS did not answer" in res.output and "launch/etcd.sh" in res.output


def test_a_busy_dock_port_and_too_little_host_memory_fail(in_repo, tiny_model):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        res = _doctor(f"dock.port={s.getsockname()[1]}", "rollout.kv_cache_gib=4096")
    assert res.exit_code == 2, res.output
    assert "FAIL  dock ports" in res.output and "busy" in res.output and "pick another dock.port" in res.output
    assert "FAIL  host memory" in res.output and "lower rollout.kv_cache_gib" in res.output


def test_a_small_dev_shm_fails_with_the_fix():
    assert os.geteuid() == 0 and shutil.which("unshare"), (
        "this check mounts a small tmpfs over /dev/shm in a private mount namespace"
    )
    cmd = f"mount -t tmpfs -o size=1m tmpfs /dev/shm && exec {sys.executable} -m spmd_rl.cli doctor {QUICK}"
    res = subprocess.run(
        ["unshare", "-m", "sh", "-c", cmd], cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 2, res.stdout + res.stderr
    assert "FAIL  /dev/shm: 1 MiB free, 64 MiB needed on cpu -> remount it larger" in res.stdout, res.stdout


def test_an_untested_version_is_a_warning(in_repo, tiny_model, monkeypatch):
    monkeypatch.setitem(doctor.TESTED, "transformers", "0.0.1")
    res = _doctor()
    assert res.exit_code == 0, res.output
    assert "warn  transformers:" in res.output and "tested with 0.0.1" in res.output


def test_auto_checks_dev_shm_for_the_device_the_ranks_will_use(monkeypatch, tmp_path):
    """``trainer.device: auto`` (the default) on a GPU node: the ranks pick CUDA, so /dev/shm
    must hold NCCL's GiB. The check read auto as CPU (64 MiB), and Docker's default 64 MiB passed."""
    import types

    from spmd_rl.distributed import accelerator

    monkeypatch.setattr(
        accelerator,
        "detect",
        lambda kind="auto", local_rank=None: types.SimpleNamespace(kind="cuda" if kind == "auto" else kind),
    )
    monkeypatch.setattr(doctor, "SHM_DIR", tmp_path)  # what is free there does not matter: the need does
    cfg = types.SimpleNamespace(trainer=types.SimpleNamespace(device="auto"))
    assert "needed on cuda" in doctor.shm(cfg).detail and "1024 MiB needed" in doctor.shm(cfg).detail


def test_leftover_lora_adapter_folders_are_counted_in_the_dev_shm_check(monkeypatch, tmp_path):
    import types

    left = tmp_path / "spmd-rl-lora-0123456789ab-r1" / "v3"
    left.mkdir(parents=True)
    (left / "adapter_model.safetensors").write_bytes(b"\0" * 2**21)
    monkeypatch.setattr(doctor, "SHM_DIR", tmp_path)
    check = doctor.shm(types.SimpleNamespace(trainer=types.SimpleNamespace(device="cpu")))
    assert "1 LoRA adapter folders hold 2 MiB" in check.detail, check


def test_a_restarted_rank_removes_the_adapter_folder_a_killed_one_left(monkeypatch):
    from spmd_rl.engines.vllm.adapter_sync import AdapterSync, adapter_root

    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test-run-lora-leak")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    first = adapter_root()
    (first / "v7").mkdir(parents=True, exist_ok=True)
    (first / "v7" / "adapter_model.safetensors").write_bytes(b"x")  # what a SIGKILLed rank left
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    sync = AdapterSync("base", 8, 16.0, ["q_proj"])
    try:
        assert sync.root == first and not (first / "v7").exists() and first.is_dir()
        assert oct(first.stat().st_mode & 0o777) == "0o700"
    finally:
        sync.close()
    assert not first.exists()


def test_torch_is_checked_against_the_installed_vllms_pin(monkeypatch):
    """vLLM's compiled ops are built for one torch: 0.26 on torch 2.13 fails with the fix; 0.26 on
    its 2.11 passes (a tested release: CI's vllm_range lane); 0.29 gets the untested-release
    warning; outside the range is a warning."""
    installed = {"torch": "2.13.0+cu130", "vllm": "0.26.0", "megatron-core": "0.16.1", "transformers": "5.19.0"}
    monkeypatch.setattr(doctor, "_version", installed.get)
    checks = {c.name: c for c in doctor.versions()}
    assert not checks["torch"].ok and "vLLM 0.26.0 is built for torch 2.11.0" in checks["torch"].detail
    assert "pip install torch==2.11.0" in checks["torch"].fix
    assert checks["vllm"].ok and not checks["vllm"].warn and checks["vllm"].detail == "0.26.0"
    installed["torch"] = "2.11.0+cu130"
    checks = {c.name: c for c in doctor.versions()}
    assert checks["torch"].ok and not checks["torch"].warn
    installed |= {"vllm": "0.29.1", "torch": "2.13.0"}
    checks = {c.name: c for c in doctor.versions()}
    assert checks["vllm"].ok and checks["vllm"].warn and "tested with 0.26.0 and 0.32.0 only" in checks["vllm"].detail
    installed |= {"vllm": "0.32.0+cpu", "torch": "2.13.0+cpu"}
    assert all(c.ok and not c.warn for c in doctor.versions())
    installed["vllm"] = "0.40.0"
    checks = {c.name: c for c in doctor.versions()}
    assert checks["vllm"].warn and "outside the supported" in checks["vllm"].detail and checks["torch"].ok
