"""Text of ``spmd-rl plan``: both layouts rank by rank, per-rank memory, R (Eq. 3), TCV (Eqs. 2/4)."""

from __future__ import annotations

from spmd_rl.recipe.estimates import (
    DTYPE_BYTES,
    GB,
    dispatch_seconds,
    lora_numels,
    redundant_memory,
    routes_bytes,
    tcv_centralized,
    tcv_per_warehouse,
    unsharded_accumulation_bytes,
)
from spmd_rl.config.layout import Layouts
from spmd_rl.config.model_arch import ModelArch
from spmd_rl.config.schema import Config
from spmd_rl.recipe.train_backends import TRAIN_BACKENDS, TrainBackend, rank_memory, role_bytes, train_backend
from spmd_rl.recipe.graph import Modes, algorithm, flow_counts, resident_roles, stages_for, written_columns

SCALAR_BYTES = 4  # the paper's B: int32 token ids / float32 values


def _gib(nbytes: float) -> str:
    return f"{nbytes / GB:10.3f} GiB"


def _span(ranks: range) -> str:
    return f"{ranks.start}-{ranks.stop - 1}" if len(ranks) > 1 else str(ranks.start)


def layout_lines(lay: Layouts, backend: TrainBackend = TRAIN_BACKENDS["fsdp"]) -> list[str]:
    train = backend.describe(lay)
    w = 13 if lay.train.pp == 1 else 15
    lines = [
        f"world {lay.world} = {lay.nnodes} node(s) x {lay.nproc_per_node} rank(s); "
        f"train {train}; gen dp={lay.gen.dp} tp={lay.gen.tp}"
        + (
            f"; separated: ranks {_span(lay.gen.ranks)} generate, {_span(lay.train.ranks)} train"
            if lay.separated
            else ""
        ),
        f"{'rank':>5} {'node':>5} {'train(dp,tp)' if lay.train.pp == 1 else 'train(dp,pp,tp)':>{w}} {'gen(dp,tp)':>11} "
        f" roles",
    ]
    for r in range(lay.world):
        roles, cells = [], []
        for name, layout in (("train", lay.train), ("gen", lay.gen)):
            if r not in layout.ranks:
                cells.append("-")
                continue
            dp, pos = layout.coords(r)
            cells.append(f"({dp},{pos})" if layout.pp == 1 else f"({dp},{pos // layout.tp},{pos % layout.tp})")
            if r == layout.dp_group_leader(dp):
                roles.append(f"{name}-DP-leader")
        if r % lay.nproc_per_node == 0:
            roles.append("warehouse")
        lines.append(f"{r:>5} {lay.node_of(r):>5} {cells[0]:>{w}} {cells[1]:>11}  {' '.join(roles)}")
    return lines


def _eq3_lines(lay: Layouts, arch: ModelArch, tw: float, ew: float, r: float, gep: int = 1) -> list[str]:
    """Paper Eq. (3) with this layout's numbers (``tw``, ``ew``: bytes; ``r``: the result; ``gep``:
    the generation EP, vLLM's expert parallelism over the rollout's TP ranks, else 1)."""
    t, p = lay.train.tp, lay.train.pp
    utp, per_device = ("UTP", f"{t}") if p == 1 else ("(UTP x UPP)", f"({t} x {p})")
    if arch.is_moe:
        return [
            f"redundant memory of the naive resharding, paper Eq. (3), {arch.num_experts} experts per sparse layer:",
            f"  R = GDP x (TW/{utp} + EW/GEP) = {lay.gen.dp} x (TW/{per_device} + EW/{gep}) = {_gib(r).strip()}"
            f"  (EW {_gib(ew).strip()}; "
            + (
                "vLLM's expert parallelism over the rollout's TP ranks: GEP = gen tp"
                if gep > 1
                else "vLLM runs the experts TP-split here, so GEP = 1"
            )
            + "); with allgather-swap R = 0",
        ]
    return [
        "redundant memory of the naive resharding, paper Eq. (3), dense model (EW = 0):",
        f"  R = GDP x TW/{utp} = {lay.gen.dp} x TW/{per_device} = {_gib(r).strip()}"
        f"  (per device TW/{utp} = {_gib(tw / (t * p)).strip()}); with allgather-swap R = 0",
    ]


def memory_lines(cfg: Config, arch: ModelArch, lay: Layouts) -> list[str]:
    mem = rank_memory(cfg, arch, lay)
    gen_bytes = DTYPE_BYTES[cfg.model.dtype]
    tw = arch.split_numel() * gen_bytes
    ew = arch.expert_numel() * gen_bytes
    gep = lay.gen.tp if cfg.parallel.gen.expert_parallel else 1  # else vLLM runs the experts TP-split: GEP = 1
    r_eq3 = redundant_memory(
        lay.gen.dp, lay.train.tp * lay.train.pp, tw, gep, ew
    )  # an update rank holds 1/(UTP x UPP) of TW
    head = [
        f"model {arch.model_type}: {arch.num_params() / 1e6:.2f} M parameters "
        f"({arch.split_numel() / 1e6:.2f} M TP-split = TW {_gib(tw).strip()} in {cfg.model.dtype})",
        f"per-rank training state ({cfg.actor.param_dtype} master, {train_backend(cfg).state})"
        + (f", training ranks {_span(lay.train.ranks)}:" if lay.separated else ":"),
        f"  params {_gib(mem.train_params)}   grads {_gib(mem.train_grads)}   optimizer {_gib(mem.train_optim)}",
    ]
    if cfg.actor.lora is not None:
        head += _lora_lines(cfg, arch, lay, mem)
    if lay.separated:  # disjoint state: nothing to swap, no redundant copy (Eq. 3 is about colocation)
        return head + [
            f"  + one gather bucket {_gib(mem.temp_buffer).strip()} while publishing weights; peak "
            f"{_gib(mem.train_state + mem.temp_buffer).strip()}",
            f"per-rank generation state, generation ranks {_span(lay.gen.ranks)} (no training state):",
            f"  weights {_gib(mem.gen_weights)}   KV cache {_gib(mem.kv_cache)}   peak "
            f"{_gib(mem.gen_weights + mem.kv_cache).strip()}",
            f"  + one broadcast bucket {_gib(cfg.reshard.bucket_bytes).strip()} of host memory while receiving weights",
            "separated placement: the sides hold disjoint state, so nothing is swapped and the",
            "redundant memory of colocated resharding, paper Eq. (3), does not arise (R = 0)",
        ]
    return head + [
        "per-rank generation state:",
        f"  weights {_gib(mem.gen_weights)}   KV cache {_gib(mem.kv_cache)}   gather bucket {_gib(mem.temp_buffer)}",
        "peak device memory in the generation stage:",
        f"  naive resharding (training state resident) {_gib(mem.generation_peak(swap=False))}",
        f"  allgather-swap (training state on host)    {_gib(mem.generation_peak(swap=True))}",
        f"  saved per rank                             {_gib(mem.train_state)}",
        *(
            [
                f"actor.accumulate_unsharded: + "
                f"{_gib(unsharded_accumulation_bytes(arch, lay, cfg.model.dtype)).strip()} per rank during"
                " the update (full params in the compute dtype, full grads in float32)"
            ]
            if cfg.actor.accumulate_unsharded
            else []
        ),
        *_eq3_lines(lay, arch, tw, ew, r_eq3, gep),
    ]


def _lora_lines(cfg: Config, arch: ModelArch, lay: Layouts, mem) -> list[str]:
    """The adapters' size and the training state LoRA saves against full fine-tuning."""
    lora = cfg.actor.lora
    adapters = sum(lora_numels(arch, lora.rank, lora.target_modules))
    full = rank_memory(cfg.model_copy(update={"actor": cfg.actor.model_copy(update={"lora": None})}), arch, lay)
    return [
        f"  LoRA rank {lora.rank} on {', '.join(lora.target_modules)}: {adapters / 1e6:.3f} M adapter parameters "
        f"({100 * adapters / arch.num_params():.2f} % of the model); base frozen in {cfg.model.dtype}",
        f"  full fine-tuning would hold {_gib(full.train_state).strip()} per rank; LoRA holds "
        f"{_gib(mem.train_state).strip()}, "
        f"saved {_gib(full.train_state - mem.train_state).strip()} (the reference shares the actor's base: "
        f"no second copy of "
        f"{_gib(full.train_params // DTYPE_BYTES[cfg.actor.param_dtype] * DTYPE_BYTES[cfg.model.dtype]).strip()})",
    ]


def stage_memory(cfg: Config, arch: ModelArch, lay: Layouts) -> tuple[list[tuple[str, list[str], int]], int]:
    """(stage, resident roles, predicted bytes per rank at its entry) for every stage of the graph
    (the residency manager's ledger records the same rows), and the bytes of all the graph's
    roles resident at once (what a run without the manager would hold). Under the separated
    placement a rank holds only its side's roles: the generators the rollout engine, the
    trainers every other role."""
    critic = ModelArch.from_folder(cfg.critic.model_path or cfg.model.path) if algorithm(cfg).critic else None
    reward = ModelArch.from_folder(cfg.reward.model_path) if cfg.reward.kind == "model" else None
    size = role_bytes(cfg, arch, lay, critic, reward)
    graph = stages_for(cfg)
    rows = []
    for s in graph:
        roles = resident_roles(cfg, s, graph)
        if (
            lay.separated
        ):  # the generators run the first stage with the rollout engine alone; the trainers the rest without it
            roles = {"rollout"} if s is graph[0] else roles - {"rollout"}
        rows.append((s.name, sorted(roles), sum(size[r] for r in roles)))
    every = {r for s in graph for r in s.roles}
    if lay.separated:  # per side: the larger of the generators' and the trainers' roles
        return rows, max(size["rollout"], sum(size[r] for r in every - {"rollout"}))
    return rows, sum(size[r] for r in every)


def residency_lines(cfg: Config, arch: ModelArch, lay: Layouts) -> list[str]:
    rows, everything = stage_memory(cfg, arch, lay)
    lines = [f"{'stage':<16}{'resident roles':<36}{'bytes':>14}"]
    lines += [f"{name:<16}{' '.join(roles) or '-':<36}{_gib(b):>14}" for name, roles, b in rows]
    name, _, peak = max(rows, key=lambda r: r[2])
    lines += [
        f"peak {_gib(peak).strip()} in {name}; every role resident at once {_gib(everything).strip()}; "
        f"saved {_gib(everything - peak).strip()}",
        "(an FSDP trainable role adds its gradients during its backward pass; a megatron actor keeps its grad buffer)",
    ]
    return lines


def flow_lines(cfg: Config, lay: Layouts, bandwidth_gb_s: float) -> list[str]:
    stages = stages_for(cfg)
    n, m, c = flow_counts(stages)
    G, N = cfg.data.global_batch_size, cfg.rollout.n
    PL, SL, S = cfg.data.max_prompt_length, cfg.rollout.max_response_length, lay.nnodes
    central = tcv_centralized(G, N, SCALAR_BYTES, PL, SL, n, m)
    per_wh = tcv_per_warehouse(G, N, SCALAR_BYTES, PL, SL, n, m, c, S)
    return [
        f"stages (C = {c} controllers): {' -> '.join(s.name for s in stages)}",
        f"columns: {', '.join(written_columns(stages))}  (n = {n} response-length items, M = {m} scalars incl. index)",
        f"G={G} N={N} PL={PL} SL={SL} B={SCALAR_BYTES} S={S} warehouse(s)",
        f"  centralized buffer TCV, Eq. (2):   {central:12.6f} GB   dispatch "
        f"{dispatch_seconds(central, bandwidth_gb_s):10.3f} s",
        f"  per warehouse TCV, Eq. (4):        {per_wh:12.6f} GB   dispatch "
        f"{dispatch_seconds(per_wh, bandwidth_gb_s):10.3f} s",
        f"  (at {bandwidth_gb_s:g} GB/s per link; warehouses serve in parallel; ratio {central / per_wh:.2f}x)",
    ] + _routes_lines(cfg, stages)


def _routes_lines(cfg: Config, stages: list) -> list[str]:
    """``actor.moe.router_replay``'s column, outside the paper's formulas (one byte per expert id)."""
    if not Modes.of(cfg).records_routes:
        return []
    arch = ModelArch.from_folder(cfg.model.path)
    reads = sum("rollout_routes" in s.inputs for s in stages)
    G, N, PL, SL = (
        cfg.data.global_batch_size,
        cfg.rollout.n,
        cfg.data.max_prompt_length,
        cfg.rollout.max_response_length,
    )
    total = routes_bytes(G, N, PL, SL, arch.num_layers, arch.experts_per_token, reads)
    return [
        f"  rollout_routes (actor.moe.router_replay): G x N x (PL + SL - 1) x {arch.num_layers} layers x "
        f"{arch.experts_per_token} experts "
        f"x 1 B, written once, read by {reads} stage(s): at most {total / GB:.6f} GB per iteration, "
        f"{total / GB / max(1, cfg.parallel.nnodes):.6f} GB per warehouse"
    ]


def render(cfg: Config, arch: ModelArch, lay: Layouts, bandwidth_gb_s: float) -> str:
    sections = (
        ("Layouts", layout_lines(lay, train_backend(cfg))),
        ("Memory", memory_lines(cfg, arch, lay)),
        ("Resident per stage (per rank, at the stage's entry)", residency_lines(cfg, arch, lay)),
        ("Sample flow", flow_lines(cfg, lay, bandwidth_gb_s)),
    )
    return "\n".join(f"== {title} ==\n" + "\n".join(lines) + "\n" for title, lines in sections)
