"""Building a megatron-core ``GPTModel`` (local layer spec) from an HF folder: the
``TransformerConfig`` that reproduces the HF architecture, the process groups, and each TP
rank's slices of the checkpoint.

Equivalence (tested in float32 against the HF forward and FSDP's engine, log-probs within 1e-5):
RMSNorm with the HF ``rms_norm_eps``, SwiGLU (``gated_linear_unit`` + SiLU, fc1 = [gate; up]),
no linear biases except Qwen2's q/k/v (``add_qkv_bias``), Qwen3's per-head q/k RMSNorm
(``qk_layernorm``), rotary with HF's ``rotate_half`` layout (``rotary_interleaved=False``) and
base ``rope_theta``, softmax scale 1/sqrt(head_dim), tied or untied LM head. mcore's rotary
ignores ``position_ids`` (positions are 0..s-1 of each row), so batches are right-padded.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoConfig

from spmd_rl.engines.training.hf_weights import SafetensorsFolder
from spmd_rl.engines.megatron import cpu_compat
from spmd_rl.engines.megatron.attention import SdpaAttention
from spmd_rl.engines.megatron.hf_map import Shape, mcore_names, to_mcore, tp_dim, tp_slice
from spmd_rl.engines.megatron.pipeline import TIED_TWIN, expert_of, stage_of, to_global

ARCHS = ("qwen2", "qwen3", "llama", "qwen3_moe")


def init_groups(tp: int, pp: int, device: torch.device, ep: int = 1) -> None:
    """mcore's process groups over the world (TP innermost, then pipeline stages, then DP, as
    ``config.layout``; expert parallelism over ``ep`` consecutive DP ranks), once per process:
    the actor and the reference share them. On a device, also mcore's RNG tracker (its
    attention forks the "model-parallel-rng" generator even with dropout off, and raises when
    it was never added); on the CPU ``cpu_compat`` replaces the tracker."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if ps.model_parallel_is_initialized():
        have = (
            ps.get_tensor_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_world_size(),
            ps.get_expert_model_parallel_world_size(),
        )
        if have != (tp, pp, ep):
            raise RuntimeError(f"megatron groups exist with (tp, pp, ep)={have}, asked for {(tp, pp, ep)}")
        return
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        order="tp-cp-ep-pp-dp",
    )
    if device.type != "cpu":
        model_parallel_cuda_manual_seed(1234)  # the seed of dropout only, which every config leaves off


def transformer_config(
    hc,
    params_dtype: torch.dtype,
    compute: torch.dtype,
    tp: int,
    sequence_parallel: bool,
    recompute: bool,
    pp: int = 1,
    ep: int = 1,
):
    from megatron.core.transformer.transformer_config import TransformerConfig

    if hc.model_type not in ARCHS:
        raise ValueError(
            f"the megatron backend has no mapping for model_type {hc.model_type!r}; supported: {', '.join(ARCHS)}"
        )
    s = Shape.of(hc)
    bf16 = compute == torch.bfloat16
    return TransformerConfig(
        num_layers=s.layers,
        hidden_size=hc.hidden_size,
        ffn_hidden_size=hc.intermediate_size,
        num_attention_heads=s.nh,
        num_query_groups=s.ng,
        kv_channels=s.hd,
        normalization="RMSNorm",
        layernorm_epsilon=hc.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=_qkv_bias(hc),
        qk_layernorm=hc.model_type in ("qwen3", "qwen3_moe"),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        perform_initialization=False,
        params_dtype=params_dtype,
        bf16=bf16,
        pipeline_dtype=compute,
        tensor_model_parallel_size=tp,
        sequence_parallel=sequence_parallel,
        pipeline_model_parallel_size=pp,
        variable_seq_lengths=pp > 1,  # micro-batches differ in length and size: the stages exchange activation shapes
        moe_token_dispatcher_type="alltoall",  # (the config refuses variable lengths with the default "allgather")
        recompute_granularity="full" if recompute else None,
        recompute_method="uniform" if recompute else None,
        recompute_num_layers=1 if recompute else None,
        **_moe(hc, s, ep),
    )


def _moe(hc, s: Shape, ep: int) -> dict:
    """Qwen3-MoE's router in mcore's terms: softmax over every expert then top-k renormalised
    (``norm_topk_prob``) equals mcore's top-k of the logits then softmax over the k; without
    renormalising, mcore's ``moe_router_pre_softmax``. Experts of ``moe_intermediate_size``,
    one SequentialMLP each (no grouped GEMM), no load-balancing loss in the objective. Each
    router gets mcore's ``RouterReplay`` hook, through which ``engines.training.route_replay`` replays
    the rollout's experts and counts the router metrics."""
    if not s.experts:
        return {}
    if s.sparse != tuple(range(s.layers)):
        raise ValueError(
            "the megatron backend maps Qwen3-MoE models whose every layer is sparse (decoder_sparse_step 1, no "
            "mlp_only_layers)"
        )
    return {
        "num_moe_experts": s.experts,
        "moe_router_topk": hc.num_experts_per_tok,
        "moe_ffn_hidden_size": hc.moe_intermediate_size,
        "moe_router_pre_softmax": not getattr(hc, "norm_topk_prob", True),
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_grouped_gemm": False,
        "expert_model_parallel_size": ep,
        "moe_enable_routing_replay": True,
    }


def _qkv_bias(hc) -> bool:
    if hc.model_type == "llama" and getattr(hc, "attention_bias", False):
        raise ValueError(
            "the megatron backend does not map Llama's attention_bias (o_proj bias); use actor.backend=fsdp"
        )
    return hc.model_type == "qwen2"


def rope_base(hc) -> int:
    params = getattr(hc, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "default":
        raise ValueError(f"the megatron backend maps only default rotary embeddings, not {params.get('rope_type')!r}")
    return int(params.get("rope_theta") or hc.rope_theta)


def _gpt_model(hc, cfg, s: Shape, pp: int, stage: int, device: torch.device):
    """An uninitialised mcore GPTModel of pipeline stage ``stage`` (local layer spec with SDPA
    core attention, ``attention.SdpaAttention``; RMSNorm, default rotary embeddings, dense or
    MoE layers) for the HF config ``hc``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    spec = get_gpt_layer_local_spec(
        num_experts=s.experts or None, moe_grouped_gemm=False, qk_layernorm=cfg.qk_layernorm, normalization="RMSNorm"
    )
    spec.submodules.self_attention.submodules.core_attention = SdpaAttention
    # a tied last stage moves its embedding copy with .cuda() to sum it over stages
    with cpu_compat.cuda_as_cpu(device):
        return GPTModel(
            config=cfg,
            transformer_layer_spec=spec,
            vocab_size=hc.vocab_size,
            max_sequence_length=hc.max_position_embeddings,
            position_embedding_type="rope",
            rotary_base=rope_base(hc),
            share_embeddings_and_output_weights=s.tied,
            pre_process=stage == 0,
            post_process=stage == pp - 1,
        )


def build_model(  # noqa: PLR0913
    path: str | Path,
    params_dtype: torch.dtype,
    compute: torch.dtype,
    tp: int,
    tp_rank: int,
    sequence_parallel: bool = False,
    recompute: bool = False,
    pp: int = 1,
    stage: int = 0,
    device: torch.device = torch.device("cpu"),
    ep: int = 1,
    ep_rank: int = 0,
):
    """(mcore GPTModel of pipeline stage ``stage`` holding this TP rank's slices of the
    checkpoint, and this EP rank's experts, in ``params_dtype``; its ``Shape``). Each full
    tensor is read, mapped (``hf_map.to_mcore``) and sliced one at a time, so the transient is
    one full tensor."""
    hc = AutoConfig.from_pretrained(path)
    cfg = transformer_config(hc, params_dtype, compute, tp, sequence_parallel, recompute, pp, ep)
    s = Shape.of(hc)
    model = _gpt_model(hc, cfg, s, pp, stage, device)
    folder = SafetensorsFolder(path)
    per = s.experts // ep
    own = {to_global(n, s.layers, pp, stage, s.tied, per, ep_rank): p for n, p in model.named_parameters()}
    mine = lambda n: stage_of(n, s.layers, pp) == stage and (expert_of(n) is None or expert_of(n) // per == ep_rank)
    expected = [n for n in mcore_names(s, cfg.add_qkv_bias, cfg.qk_layernorm) if mine(n)]
    if pp > 1 and s.tied and stage == pp - 1:
        expected.append(TIED_TWIN)
    if sorted(own) != sorted(expected):
        raise RuntimeError(f"mcore parameters differ from the mapping: {sorted(set(own) ^ set(expected))}")
    with torch.no_grad():
        for name in expected:
            own[name].copy_(tp_slice(name, to_mcore(name, folder.read, s), tp, tp_rank).to(params_dtype))
            if (
                tp_dim(name) is not None
            ):  # mcore tags TP weights only when it initialises them (perform_initialization);
                # untagged, every rank but TP rank 0 counts them as replicas and leaves them out of the grad norm
                own[name].tensor_model_parallel, own[name].partition_dim, own[name].partition_stride = (
                    True,
                    tp_dim(name),
                    1,
                )
    return model, s
