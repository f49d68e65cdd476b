"""``spmd-rl doctor``'s GPU-node checks (``launcher.device_checks``, issue 70 finding 6), judged
on this CPU from what the run will use: each check for a ``cuda`` node, with the node's
environment, compilers and driver given."""

from __future__ import annotations

import pytest

from spmd_rl.config.loader import load_config
from spmd_rl.config.model_arch import ModelArch
from spmd_rl.launcher.device_checks import alloc_conf, c_compiler, cuda_driver
from tests.conftest import REPO

CFG = load_config(REPO / "configs/quickstart.yaml", [])
GRAPHS = load_config(REPO / "configs/quickstart.yaml", ["rollout.vllm.enforce_eager=false"])


@pytest.fixture(scope="module")
def archs(tiny_model, tiny_moe) -> tuple[ModelArch, ModelArch]:
    dense, moe = ModelArch.from_folder(tiny_model), ModelArch.from_folder(tiny_moe)
    assert dense.num_experts == 0 and moe.num_experts > 0
    return dense, moe


def test_expandable_segments_beside_sleep_mode_fail_on_a_gpu_only():
    env = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512, expandable_segments:True"}
    bad = alloc_conf(CFG, "cuda", env)
    assert not bad.ok and "expandable_segments" in bad.fix
    assert alloc_conf(CFG, "cuda", {"PYTORCH_ALLOC_CONF": "expandable_segments:False"}).ok
    assert alloc_conf(CFG, "cuda", {}).ok
    assert alloc_conf(CFG, "cpu", env) is None  # no sleep mode on the CPU
    hf = load_config(REPO / "configs/quickstart.yaml", ["rollout.engine=hf"])
    assert alloc_conf(hf, "cuda", env) is None  # only vLLM's sleep mode refuses it


def test_a_c_compiler_is_needed_for_cuda_graphs_and_fused_moe_only(archs):
    DENSE, MOE = archs  # noqa: N806
    none = lambda name: None  # noqa: E731
    assert c_compiler(CFG, DENSE, "cuda", {}, none) is None  # eager and dense: Triton builds nothing
    for cfg, arch, why in ((GRAPHS, DENSE, "CUDA graphs"), (CFG, MOE, "fused MoE")):
        got = c_compiler(cfg, arch, "cuda", {}, none)
        assert not got.ok and why in got.detail and "gcc" in got.fix
    assert c_compiler(GRAPHS, DENSE, "cuda", {"CC": "/opt/bin/mycc"}, none).ok
    assert c_compiler(GRAPHS, DENSE, "cuda", {}, lambda n: "/usr/bin/gcc" if n == "gcc" else None).ok
    assert c_compiler(GRAPHS, MOE, "cpu", {}, none) is None


def test_a_driver_older_than_torchs_cuda_fails_and_an_older_minor_warns():
    assert not cuda_driver("cuda", "13.0", (12, 8)).ok
    minor = cuda_driver("cuda", "12.8", (12, 4))
    assert minor.ok and minor.warn
    same = cuda_driver("cuda", "13.0", (13, 0))
    assert same.ok and not same.warn
    assert cuda_driver("cuda", "13.0", None).warn
    assert cuda_driver("cuda", None, (12, 0)) is None and cuda_driver("cpu", "13.0", (12, 0)) is None


def test_a_dev_shm_too_small_for_the_separated_handoff_is_a_warning(archs, monkeypatch):
    import types

    from spmd_rl.launcher import doctor

    sep = load_config(
        REPO / "configs/quickstart.yaml",
        [
            "parallel.placement=separated",
            "parallel.gen_ranks=1",
            "parallel.gen.dp=1",
            "parallel.train.dp_shard=1",
            "actor.correction.tis_cap=2.0",
        ],
    )
    roomy = doctor.weight_handoff(sep, archs[0])
    assert roomy.ok and not roomy.warn
    monkeypatch.setattr(doctor.os, "statvfs", lambda _: types.SimpleNamespace(f_bavail=1, f_frsize=2**20))
    small = doctor.weight_handoff(sep, archs[0])
    assert small.ok and small.warn and "disk" in small.detail and "shm-size" in small.fix
