"""Closed-form estimates printed by ``spmd-rl plan``: per-rank memory of both engine states,
the paper's redundant memory R (Eq. 3) and the sample-flow volumes TCV (Eqs. 2 and 4).

Units follow the paper: 1 GB = 1024**3 bytes, 1 MB = 1024**2 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from spmd_rl.config.layout import Layouts
from spmd_rl.config.model_arch import ModelArch
from spmd_rl.config.schema import Config

GB = 1024**3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def tcv_centralized(G: int, N: int, B: int, PL: int, SL: int, n: int, M: int) -> float:
    """Paper Eq. (2): TCV = G x N x B x (2PL + 3n x SL + 8M) / 1024^3  [GB] through one buffer."""
    return G * N * B * (2 * PL + 3 * n * SL + 8 * M) / GB


def tcv_per_warehouse(  # noqa: PLR0913
    G: int, N: int, B: int, PL: int, SL: int, n: int, M: int, C: int, S: int
) -> float:
    """Paper Eq. (4): TCV = G x N x B x [2PL + 3n x SL + 8(C+1)M] / S / 1024^3  [GB] per warehouse,
    with C controllers and S warehouses."""
    return G * N * B * (2 * PL + 3 * n * SL + 8 * (C + 1) * M) / S / GB


def routes_bytes(G: int, N: int, PL: int, SL: int, layers: int, top_k: int, reads: int) -> int:
    """Bytes the ``rollout_routes`` column moves per iteration at most: one uint8 expert id per
    (position, layer, routed expert) over the PL + SL - 1 routed positions of each of the G x N
    samples, written once and read by ``reads`` stages."""
    return G * N * (PL + SL - 1) * layers * top_k * (1 + reads)


def dispatch_seconds(tcv_gb: float, bandwidth_gb_s: float) -> float:
    """Time to move ``tcv_gb`` over one link of ``bandwidth_gb_s`` (GB/s, 1 GB = 1024^3 B)."""
    return tcv_gb / bandwidth_gb_s


def redundant_memory(gdp: int, utp: int, tw_bytes: float, gep: int = 1, ew_bytes: float = 0.0) -> float:
    """Paper Eq. (3): R = GDP x (TW/UTP + EW/GEP), the redundant bytes the naive resharding
    keeps (TW: TP-split weights, EW: expert weights, GDP/GEP: generation DP/EP, UTP: update TP)."""
    return gdp * (tw_bytes / utp + ew_bytes / gep)


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank holds, by category."""

    train_params: int
    train_grads: int
    train_optim: int
    gen_weights: int
    kv_cache: int
    temp_buffer: int

    @property
    def train_state(self) -> int:
        return self.train_params + self.train_grads + self.train_optim

    def generation_peak(self, swap: bool) -> int:
        """Peak during the generation stage: allgather-swap keeps only the generation weights,
        the KV cache and one gather bucket on the device; the naive path keeps the training
        state resident as well."""
        return self.gen_weights + self.kv_cache + self.temp_buffer + (0 if swap else self.train_state)


def gen_weight_numel(arch: ModelArch, lay: Layouts) -> int:
    """Elements of one generation rank's weights: TP-split tensors over gen tp, the rest whole."""
    return sum(t.numel // lay.gen.tp if t.tp_split else t.numel for t in arch.tensors())


def fsdp_memory(cfg: Config, arch: ModelArch, lay: Layouts) -> RankMemory:
    """Per-rank bytes under the FSDP backend. FSDP2 shards every training tensor over dp_shard after the training TP
    plan has split attention/MLP projections (embeddings and norms stay whole); AdamW keeps two
    states per parameter in the master dtype. vLLM keeps the TP slice of split tensors (its
    embedding is vocab-parallel) and a full copy of replicated ones. With ``actor.lora`` the
    base is frozen in ``model.dtype`` and gradients and AdamW cover the adapters only
    (``lora_numels``, each sharded over dp_shard)."""
    pb = DTYPE_BYTES[cfg.actor.param_dtype]
    gb = DTYPE_BYTES[cfg.model.dtype]
    train_numel = gen_numel = 0
    for t in arch.tensors():
        local = t.numel // lay.train.tp if t.train_tp_split else t.numel
        train_numel += -(-local // lay.train.dp)
        gen_numel += t.numel // lay.gen.tp if t.tp_split else t.numel
    lora = cfg.actor.lora  # the base frozen in the compute dtype; grads and AdamW over the adapters only
    frozen, trained = (
        (train_numel, sum(-(-n // lay.train.dp) for n in lora_numels(arch, lora.rank, lora.target_modules)))
        if lora is not None
        else (0, train_numel)
    )
    # engines.fsdp.bucket_gather: two buckets in flight within bucket_bytes, unless the largest tensor
    # alone (its gather output plus this rank's 1/dp input) exceeds half of it
    lone = arch.largest_tensor_numel() * gb * (1 + (1 / lay.train.dp if lay.train.dp > 1 else 0))
    temp = max(cfg.reshard.bucket_bytes, int(2 * lone))
    return RankMemory(
        train_params=frozen * gb + trained * pb,
        train_grads=trained * pb,
        train_optim=2 * trained * pb,
        gen_weights=gen_numel * gb,
        kv_cache=int(cfg.rollout.kv_cache_gib * GB),
        temp_buffer=temp,
    )


def lora_numels(arch: ModelArch, rank: int, targets: list[str]) -> list[int]:
    """Elements of each adapter tensor (A: r x in, B: out x r) of every targeted dense linear
    layer (``engines.training.lora``; fused MoE experts are never adapted)."""
    h, q, kv = arch.hidden_size, arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    f = arch.intermediate_size
    shapes = {
        "q_proj": (q, h),
        "k_proj": (kv, h),
        "v_proj": (kv, h),
        "o_proj": (h, q),
        "gate_proj": (f, h),
        "up_proj": (f, h),
        "down_proj": (h, f),
    }
    out = []
    for layer in range(arch.num_layers):
        for t in targets:
            if t in shapes and (t in ("q_proj", "k_proj", "v_proj", "o_proj") or layer not in arch.sparse_layers):
                o, i = shapes[t]
                out += [rank * i, o * rank]
    return out


def megatron_local_numel(arch: ModelArch, tp: int, pp: int = 1, ep: int = 1, experts_only: bool = False) -> int:
    """Elements of one rank's parameters under megatron-core, on its largest pipeline stage:
    every TP-split tensor of the generation engine's split (the embedding and LM head
    vocab-parallel too) over tp, norms whole; stage k holds decoder layers [k L/pp, (k+1) L/pp),
    the embedding is on the first stage, the final norm and LM head on the last (which holds a
    copy of a tied embedding when pp > 1: ``engines.megatron.pipeline``); MoE experts are split
    over ep and not over tp (the backend runs MoE at tp 1). ``experts_only``: the expert part."""
    per = max(1, arch.num_layers // pp)
    stages = [0] * pp
    for t in arch.tensors():
        if experts_only and not t.expert:
            continue
        n = t.numel // ep if t.expert else t.numel // tp if t.tp_split else t.numel
        if t.name.startswith("model.layers."):
            stages[min(pp - 1, int(t.name.split(".")[2]) // per)] += n
        elif t.name == "model.embed_tokens.weight":
            stages[0] += n
            if pp > 1 and arch.tie_word_embeddings:
                stages[-1] += n
        else:
            stages[-1] += n
    return max(stages)


def megatron_memory(cfg: Config, arch: ModelArch, lay: Layouts) -> RankMemory:
    """Per-rank bytes under megatron-core with the distributed optimizer (``engines.megatron``): every DP rank holds
    its stage's TP-local parameters in the model's dtype (``model.dtype`` under mixed precision), their
    float32 gradient buffer (Megatron DDP reduces in float32 and keeps the buffer for the run),
    and 1/dp of the float32 AdamW moments, plus 1/dp of float32 main parameters when the model
    dtype is not ``actor.param_dtype``. The gather for vLLM holds one parameter's TP parts and
    the joined tensor at a time."""
    ep = cfg.parallel.train.ep
    gen_bytes = gen_weight_numel(arch, lay) * DTYPE_BYTES[cfg.model.dtype]
    tp_local = megatron_local_numel(arch, lay.train.tp, lay.train.pp, ep)
    experts = megatron_local_numel(arch, lay.train.tp, lay.train.pp, ep, experts_only=True)
    mixed = cfg.model.dtype != cfg.actor.param_dtype
    shard = -(-(tp_local - experts) // lay.train.dp) + -(
        -experts // (lay.train.dp // ep)
    )  # experts: over the expert DP group
    gb = DTYPE_BYTES[cfg.model.dtype]
    return RankMemory(
        train_params=tp_local * DTYPE_BYTES[cfg.model.dtype if mixed else cfg.actor.param_dtype],
        train_grads=tp_local * 4,
        train_optim=shard * 4 * (3 if mixed else 2),
        gen_weights=gen_bytes,
        kv_cache=int(cfg.rollout.kv_cache_gib * GB),
        temp_buffer=2 * arch.largest_tensor_numel() * gb,
    )


def unsharded_accumulation_bytes(arch: ModelArch, lay: Layouts, compute_dtype: str) -> int:
    """Extra per-rank bytes of ``actor.accumulate_unsharded`` during an update: the parameters
    unsharded over dp_shard in the compute dtype plus their gradients accumulated in float32
    (FSDP2's reduce dtype), less the 1/dp_shard share a rank holds anyway."""
    tp_local = sum(t.numel // lay.train.tp if t.train_tp_split else t.numel for t in arch.tensors())
    return int(tp_local * (DTYPE_BYTES[compute_dtype] + 4) * (1 - 1 / lay.train.dp))


def sharded_numel(tensors, lay: Layouts) -> int:
    """Local elements of ``tensors`` on one training rank (TP split, then FSDP over dp_shard)."""
    return sum(-(-(t.numel // lay.train.tp if t.train_tp_split else t.numel) // lay.train.dp) for t in tensors)
