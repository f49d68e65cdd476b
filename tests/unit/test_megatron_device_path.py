"""megatron's build takes the same patched path on every device (issue 70, finding 1): the
patches a device needs must not hide behind the CPU check. A fresh process runs the engine's
patch step for a CUDA device (on this CPU: the CPU-only patches are skipped, as on a GPU) and
then builds the local spec's RMSNorm with sequence parallel on, as every TP + SP layer does."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO, subprocess_env

PROBE = """
import torch
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from spmd_rl.engines.megatron import cpu_compat
from spmd_rl.engines.megatron.engine import patch_megatron

patch_megatron(torch.device("cuda"))
assert not cpu_compat._applied, "the CPU patches ran for a CUDA device"
cfg = TransformerConfig(
    num_layers=1, hidden_size=8, num_attention_heads=2, tensor_model_parallel_size=2, sequence_parallel=True,
    normalization="RMSNorm", use_cpu_initialization=True,
)
norm = WrappedTorchNorm(cfg, 8)
assert cfg.sequence_parallel and all(p.sequence_parallel for p in norm.parameters())
print("built")
"""


def test_the_rmsnorm_of_a_tp_sp_layer_builds_on_a_device_path():
    res = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0 and "built" in res.stdout, res.stderr[-3000:]
