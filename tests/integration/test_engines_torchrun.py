"""Training engine -> allgather-swap -> in-process vLLM under real torchrun on CPU, in both
directions of layout change. Independent references: HF generate and HF weights.
``reshard.mode`` (naive vs allgather_swap) and ``reshard.bucket_bytes`` (the bounded gather
buffer) are checked through the ledger and the temporary peak."""

from __future__ import annotations

import json

import pytest

from spmd_rl.recipe.train_backends import rank_memory
from spmd_rl.config.layout import Layout, Layouts
from spmd_rl.config.loader import load_config
from spmd_rl.config.model_arch import ModelArch
from tests.conftest import REPO
from tests.torchrun_util import QUIET_CHILD_ENV, OwnShm, run_nodes


@pytest.mark.slow
@pytest.mark.parametrize(
    "model,train_dp,train_tp,gen_tp",
    [("dense", 2, 1, 2), ("dense", 1, 2, 1), ("moe", 2, 1, 2)],
    ids=["train-dp2-to-gen-tp2", "train-tp2-to-gen-dp2", "moe-train-dp2-to-gen-tp2"],
)
def test_reshard_swap_rollout(request, tmp_path, model, train_dp, train_tp, gen_tp):
    """``moe``: the tiny Qwen3-MoE, whose experts the trainer holds fused per layer and the sync
    sends one by one under the checkpoint's names (``engines.training.fused_experts``)."""
    tiny_model = request.getfixturevalue("tiny_model" if model == "dense" else "tiny_moe")
    env = QUIET_CHILD_ENV | {
        "MODEL": str(tiny_model),
        "SPMD_RL_OUT": str(tmp_path),
        "TRAIN_DP": str(train_dp),
        "TRAIN_TP": str(train_tp),
        "GEN_TP": str(gen_tp),
    }
    with OwnShm(period_s=0.2) as shm:
        run_nodes(
            REPO / "tests/helpers/engine_worker.py",
            nnodes=1,
            nproc_per_node=2,
            env=env,
            log_dir=tmp_path,
            timeout_s=600,
        )
    assert not shm.named_cpushm()  # vLLM's CPU TP segments: unlinked once mapped (engines.vllm.shm)
    for rank in range(2):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        # before and after three weight updates: vLLM greedy == HF greedy on the training weights
        assert r["greedy_equal"] == [True] * 4
        # rollout log-probs vs training-engine log-probs of the same sequences
        # float32: vLLM's CPU forward vs the training engine's, each ~1e-5 from float64; 1e-4 ~7x
        assert max(r["max_logprob_diff"]) < 1e-4
        # vLLM's unpacked weights (embedding rows, qkv bias, final norm) == this rank's TP slice
        assert r["vllm_weights_bit_exact"] == [True] * 4
        # swap round trip bit-exact; nothing of the training params resident while generating
        assert r["swap_bit_exact"] == [True] * 4 and r["resident_params_during_gen"] == [0] * 4
        # 3 updates with swaps in between == the same 3 updates never swapped
        assert r["swapped_equals_unswapped"]
        # bounded gather buffers: two buckets in flight within 64 KiB, or twice a lone tensor's
        # cost: FSDP over 2 ranks its output plus its half-size input, TP over 2 its TP-local
        # half plus full_tensor's gather and reorder (bucket_gather); naive gathers all at once
        lone = 1.5 if train_tp == 1 else 2.5
        assert r["temp_peak_swap"] <= max(64 << 10, 2 * lone * r["largest_param_bytes"])
        assert r["temp_peak_naive"] >= r["model_bytes"] // train_tp  # one dp gather of every TP-local tensor
        # the ledger's KV cache is what vLLM allocated (CPU: the 1 GiB VLLM_CPU_KVCACHE_SPACE)
        assert r["ledger_kv_cache"] == 1 << 30
        # ledger: naive minus allgather-swap during generation == the swapped training state,
        # as predicted from the config alone (fp32 params + 2 AdamW states; grads freed)
        cfg = load_config(REPO / "configs/quickstart.yaml", [f"model.path={tiny_model}"])
        lay = Layouts(2, 2, Layout(train_dp, train_tp), Layout(2 // gen_tp, gen_tp))
        mem = rank_memory(cfg, ModelArch.from_folder(tiny_model), lay)
        assert r["ledger_saving"] == r["ledger_train_state"] == mem.train_params + mem.train_optim
