"""vLLM's CPU shared-memory segment names are per job, checked on vLLM's own
naming function: under vLLM's name two jobs on one host get the same segment name; under
``vllm_shm.name_per_job`` they differ, and the ranks of one job still agree (vLLM checks that
before it uses the segments, and falls back to plain torch.distributed if they disagree).

vLLM builds the SHM communicator only where its CPU extension has ``init_shm_manager`` (the
AVX512 build; the AVX2 build has none): test_one_host's two concurrent jobs exercise the
collision there, and here they check only that two jobs run at once."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from spmd_rl.engines.vllm import shm as vllm_shm

JOB_A = {
    "SPMD_RL_JOB_TOKEN": "a" * 32,
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RESTART_COUNT": "0",
}
JOB_B = JOB_A | {"SPMD_RL_JOB_TOKEN": "b" * 32, "MASTER_PORT": "29611"}
TP_GROUP = SimpleNamespace(unique_name="tp:0", ranks=[0, 1])


def _name(monkeypatch, env: dict[str, str]) -> str:
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

    for k in vllm_shm.JOB_ENV:
        monkeypatch.delenv(k, raising=False)
    for k, v in (env | {"VLLM_DIST_IDENT": "//"}).items():  # what vLLM's CPU worker sets under torchrun (env://)
        monkeypatch.setenv(k, v)
    return _CPUSHMDistributed.make_group_name(TP_GROUP)


@pytest.fixture
def vllm_naming(monkeypatch):
    """vLLM's make_group_name restored after the test (name_per_job patches the class)."""
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

    monkeypatch.setattr(_CPUSHMDistributed, "make_group_name", _CPUSHMDistributed.__dict__["make_group_name"])


@pytest.mark.usefixtures("vllm_naming")
def test_vllm_names_collide_across_jobs_and_per_job_names_do_not(monkeypatch):
    assert _name(monkeypatch, JOB_A) == _name(monkeypatch, JOB_B)  # vLLM's own: every job the same name
    vllm_shm.name_per_job()
    vllm_shm.name_per_job()  # idempotent: one tag, not two
    a, b = _name(monkeypatch, JOB_A), _name(monkeypatch, JOB_B)
    assert a != b and a.endswith("-cpushm-" + vllm_shm.job_tag()) is False  # the env left by the last call is B's
    assert b.endswith("-cpushm-" + vllm_shm.job_tag())
    assert a == _name(monkeypatch, JOB_A)  # every rank of job A (same env) computes the same name
    restarted = _name(monkeypatch, JOB_A | {"TORCHELASTIC_RESTART_COUNT": "1"})
    assert restarted != a  # a restarted group never meets a segment its killed predecessor left
    assert JOB_A["SPMD_RL_JOB_TOKEN"] not in a  # the token is hashed, never shown in /dev/shm
