"""Cross-field validation: every rule that relates fields to each other, to the world size, to
the model's config.json or to files on disk. ``check`` returns all violations at once and
loads no weights and starts no process group.

Paths are resolved against the current directory.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

from spmd_rl.catalog import findable
from spmd_rl.algos.specs import AlgorithmSpec
from spmd_rl.recipe.backend_rules import check_gen_experts, check_router_replay
from spmd_rl.recipe.dpo_rules import check_dpo
from spmd_rl.recipe.env_rules import check_environment
from spmd_rl.recipe.replica_rules import check_replicas
from spmd_rl.config.errors import Violation
from spmd_rl.config.layout import Layouts, resolve_layouts
from spmd_rl.config.model_arch import SUPPORTED_TYPES, ModelArch
from spmd_rl.config.rollout_engines import ROLLOUTS, missing
from spmd_rl.config.schema import Config
from spmd_rl.recipe.graph import Modes, algorithm, data_columns, fused_stages, stages_for
from spmd_rl.recipe.stream_rules import check_partial, check_separated
from spmd_rl.recipe.train_backends import check_backend, train_backend
from spmd_rl.data.files import check_safetensors, sniff_dataset
from spmd_rl.rewards.registry import RULES

_ENDPOINT = re.compile(r"^(https?://)?[A-Za-z0-9_.\-\[\]:]+:\d{1,5}$")


def _multiple(n: int, k: int) -> int:
    """Smallest positive multiple of k that is >= n."""
    return max(k, -(-n // k) * k)


def _check_batches(cfg: Config, lay: Layouts) -> list[Violation]:
    """G prompts x N samples split evenly over both DP layouts (whole groups where the estimator
    reads them), then the mini- and micro-batches (``_check_minibatches``)."""
    out: list[Violation] = []
    g, n = cfg.data.global_batch_size, cfg.rollout.n
    tdp, gdp = lay.train.dp, lay.gen.dp
    if g % gdp:
        out.append(
            Violation(
                "data.global_batch_size",
                g,
                f"not divisible by the generation DP size {gdp}",
                f"use a multiple of {gdp}, e.g. {_multiple(g, gdp)}",
            )
        )
    if (g * n) % tdp:
        out.append(
            Violation(
                "data.global_batch_size",
                g,
                f"G x N = {g * n} samples not divisible by the training DP size {tdp}",
                f"make G x rollout.n a multiple of {tdp}",
            )
        )
    spec = algorithm(cfg)
    if spec.group_relative and g % tdp:
        out.append(
            Violation(
                "data.global_batch_size",
                g,
                f"{cfg.algorithm.name} gives whole prompt groups to the {tdp} training DP groups; "
                f"{g} groups leave some with {g // tdp} and others with {g // tdp + 1} (or none), and their "
                f"collectives stop matching",
                f"use a multiple of the training DP size {tdp}, e.g. {_multiple(g, tdp)}, or a smaller "
                f"parallel.train.dp_shard",
            )
        )
    return out + _check_minibatches(cfg, lay)


def _check_minibatches(cfg: Config, lay: Layouts) -> list[Violation]:
    """Mini-batches divide G (whole pairs per DP group for DPO) and split over training DP;
    micro-batches divide a rank's share; a token budget holds one full-length sample."""
    out: list[Violation] = []
    g, n, tdp, spec = cfg.data.global_batch_size, cfg.rollout.n, lay.train.dp, algorithm(cfg)
    mb = cfg.actor.mini_batch_size
    if g % mb:
        out.append(
            Violation(
                "actor.mini_batch_size",
                mb,
                f"does not divide data.global_batch_size={g}",
                "use a divisor of the global batch size",
            )
        )
    elif spec.advantage == "preference" and mb % tdp:  # the one update that reads a group (its pair) whole
        out.append(
            Violation(
                "actor.mini_batch_size",
                mb,
                f"dpo splits each mini-batch's whole pairs over the {tdp} training DP groups: "
                f"{mb} groups do not split evenly (ranks would take different numbers of optimizer steps)",
                f"use a multiple of {tdp} that divides data.global_batch_size={g}",
            )
        )
    elif (mb * n) % tdp:
        out.append(
            Violation(
                "actor.mini_batch_size",
                mb,
                f"mini-batch x N = {mb * n} samples not divisible by the training DP size {tdp}",
                f"make mini_batch_size x rollout.n a multiple of {tdp}",
            )
        )
    else:
        per_rank = mb * n // tdp
        for field, micro in (
            ("actor.micro_batch_size", cfg.actor.micro_batch_size),
            ("ref.micro_batch_size", cfg.ref.micro_batch_size),
        ):
            if micro is not None and per_rank % micro:
                out.append(
                    Violation(
                        field,
                        micro,
                        f"does not divide the {per_rank} samples each rank gets per mini-batch",
                        f"use a divisor of {per_rank}",
                    )
                )
    budget, longest = cfg.actor.micro_batch_tokens, cfg.data.max_prompt_length + cfg.rollout.max_response_length
    if budget is not None and budget < longest:
        out.append(
            Violation(
                "actor.micro_batch_tokens",
                budget,
                f"is below one full-length sample (data.max_prompt_length + rollout.max_response_length = {longest})",
                f"use at least {longest}, or null for micro_batch_size samples per micro-batch",
            )
        )
    return out


def _check_model(cfg: Config, lay: Layouts) -> list[Violation]:
    """The model folder reads as a supported architecture that both TP sizes split, with room
    for the longest sample, intact weights and the tokenizer it names."""
    folder = Path(cfg.model.path)
    cfg_json = folder / "config.json"
    if not cfg_json.is_file():
        problem = "folder not found" if not folder.is_dir() else "has no config.json"
        return [
            Violation(
                "model.path",
                cfg.model.path,
                problem,
                "point it at a local HF model folder (build the tiny one with tools/make_tiny_model.py)",
            )
        ]
    try:
        arch = ModelArch.from_folder(folder)
    except (KeyError, ValueError) as exc:
        return [
            Violation(
                "model.path",
                cfg.model.path,
                f"config.json lacks or mangles {exc}",
                "use a Qwen2/Qwen3/Llama/Qwen3-MoE config.json",
            )
        ]
    return _check_model_shape(cfg, lay, arch) + _check_model_files(cfg, arch)


def _check_model_shape(cfg: Config, lay: Layouts, arch: ModelArch) -> list[Violation]:
    out: list[Violation] = []
    if arch.model_type not in SUPPORTED_TYPES:
        out.append(
            Violation(
                "model.path",
                cfg.model.path,
                f"model_type {arch.model_type!r} is not supported",
                f"use one of {', '.join(SUPPORTED_TYPES)}",
            )
        )
    for name, tp in (("train", lay.train.tp), ("gen", lay.gen.tp)):
        counts = [
            ("num_attention_heads", arch.num_heads),
            ("num_key_value_heads", arch.num_kv_heads),
            ("intermediate_size", arch.intermediate_size),
        ]
        for what, count in counts + ([("moe_intermediate_size", arch.moe_intermediate_size)] if arch.is_moe else []):
            if count % tp:
                out.append(
                    Violation(
                        f"parallel.{name}.tp",
                        tp,
                        f"does not divide the model's {what}={count}",
                        f"use a TP size dividing {count}",
                    )
                )
    return out


def _check_model_files(cfg: Config, arch: ModelArch) -> list[Violation]:
    out: list[Violation] = []
    folder = Path(cfg.model.path)
    total = cfg.data.max_prompt_length + cfg.rollout.max_response_length
    if arch.max_positions and total > arch.max_positions:
        out.append(
            Violation(
                "rollout.max_response_length",
                cfg.rollout.max_response_length,
                f"max_prompt_length + max_response_length = {total} exceeds the model's "
                f"max_position_embeddings={arch.max_positions}",
                f"keep the sum <= {arch.max_positions}",
            )
        )
    for weights in sorted(folder.glob("*.safetensors")):
        if (problem := check_safetensors(weights)) is not None:
            out.append(
                Violation(
                    "model.path",
                    cfg.model.path,
                    f"{weights.name}: {problem}",
                    "copy the model folder again or rebuild it",
                )
            )
    tok = Path(cfg.model.tokenizer_path) if cfg.model.tokenizer_path else None
    if tok is not None and not tok.is_dir():
        out.append(
            Violation(
                "model.tokenizer_path",
                cfg.model.tokenizer_path,
                "folder not found",
                "point it at a tokenizer folder or leave it out",
            )
        )
    return out


def _check_files(cfg: Config) -> list[Violation]:
    out: list[Violation] = []
    for field, path in (("data.train_path", cfg.data.train_path), ("data.test_path", cfg.data.test_path)):
        if path is None:
            continue
        p = Path(path)
        if p.suffix not in (".jsonl", ".parquet"):
            out.append(Violation(field, path, "unsupported file type", "use a .jsonl or .parquet file"))
        elif not p.is_file():
            out.append(
                Violation(
                    field, path, "file not found", "check the path (relative paths start at the current directory)"
                )
            )
        elif (problem := sniff_dataset(p)) is not None:
            out.append(Violation(field, path, problem, f"pass a {p.suffix} file (one JSON object per line for .jsonl)"))
    return out


def _check_reward_model(cfg: Config) -> list[Violation]:
    """kind: model needs a one-label sequence classifier over the policy's vocabulary (it
    scores the policy's token ids as they are)."""
    r = cfg.reward
    if r.model_path is None:
        return [
            Violation(
                "reward.model_path",
                None,
                "reward.kind: model needs the reward model's folder",
                "set reward.model_path (tools/make_tiny_reward_model.py --model <policy> writes <policy>/reward_model)",
            )
        ]
    conf = Path(r.model_path) / "config.json"
    try:
        rm = json.loads(conf.read_text())
    except (OSError, ValueError) as exc:
        return [
            Violation(
                "reward.model_path",
                r.model_path,
                f"no readable config.json ({exc.__class__.__name__})",
                "point it at a local HF sequence-classification folder",
            )
        ]
    archs = rm.get("architectures") or []
    if not any(str(a).endswith("ForSequenceClassification") for a in archs):
        return [
            Violation(
                "reward.model_path",
                r.model_path,
                f"architectures {archs} is not a sequence classifier",
                "export the reward model with AutoModelForSequenceClassification",
            )
        ]
    labels = rm.get("num_labels", len(rm.get("id2label") or {}) or 2)
    if labels != 1:
        return [
            Violation(
                "reward.model_path",
                r.model_path,
                f"has {labels} labels; a reward model scores with one",
                "train it with num_labels=1",
            )
        ]
    try:
        policy_vocab = json.loads((Path(cfg.model.path) / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError):
        return []  # model.path's own check reports it
    if rm.get("vocab_size") != policy_vocab:
        return [
            Violation(
                "reward.model_path",
                r.model_path,
                f"vocab_size {rm.get('vocab_size')} differs from the policy's {policy_vocab}",
                "use a reward model with the policy's tokenizer",
            )
        ]
    return []


def _check_reward(cfg: Config) -> list[Violation]:
    r, out = cfg.reward, []
    if r.kind == "model":
        out += _check_reward_model(cfg)
    else:
        if r.model_path is not None:
            out.append(
                Violation(
                    "reward.model_path",
                    r.model_path,
                    "only read with reward.kind: model",
                    "remove it or set reward.kind: model",
                )
            )
        for field in ("rule_weight", "offload_to_host"):
            if field in r.model_fields_set:
                out.append(
                    Violation(
                        f"reward.{field}",
                        getattr(r, field),
                        "only read with reward.kind: model",
                        "remove it or set reward.kind: model",
                    )
                )
    if out:
        return out
    if r.rule in RULES:
        return []
    if r.format_score != 0:
        return [
            Violation(
                "reward.format_score",
                r.format_score,
                f"a module:function rule ({r.rule}) has no notion of a well-formed answer",
                "return the format reward from your function and set format_score: 0",
            )
        ]
    module, sep, func = r.rule.partition(":")
    if not sep or not module or not func.isidentifier():
        return [
            Violation(
                "reward.rule",
                r.rule,
                "neither a registered rule nor module:function",
                f"use one of {', '.join(RULES)} or my_pkg.rewards:score",
            )
        ]
    if not findable(r.rule):
        return [
            Violation(
                "reward.rule",
                r.rule,
                f"module {module!r} not importable",
                "put it on PYTHONPATH or fix the module name",
            )
        ]
    return []


def _check_algorithm(cfg: Config) -> list[Violation]:
    """The algorithm's spec against the fields it reads: group size, critic, objective terms,
    rollout correction."""
    spec = algorithm(cfg)
    return (
        _check_groups(cfg, spec)
        + _check_critic_fields(cfg, spec)
        + _check_objective_terms(cfg, spec)
        + _check_correction(cfg, spec)
        + _check_advantage_stage(cfg, spec)
    )


def _check_advantage_stage(cfg: Config, spec: AlgorithmSpec) -> list[Violation]:
    """A user's advantage stage reads only columns written before it, and the reward as the
    reward stage wrote it (it is not handed the KL terms the built-in one subtracts)."""
    if not spec.advantage_stage:
        return []
    out = []
    graph = stages_for(cfg)
    k = next(i for i, s in enumerate(graph) if s.name == "advantage")
    written = set(data_columns(cfg)).union(*(s.outputs for s in graph[:k]))
    unknown = [c for c in spec.advantage_inputs if c not in written]
    if unknown:
        out.append(
            Violation(
                "algorithm.name",
                cfg.algorithm.name,
                f"its advantage stage reads {', '.join(unknown)}, which no stage before it writes in this config",
                f"read only columns written before it: {', '.join(sorted(written))}",
            )
        )
    if Modes.of(cfg).kl_in_reward:
        out.append(
            Violation(
                "algorithm.kl_coef",
                cfg.algorithm.kl_coef,
                f"{cfg.algorithm.name}'s advantage stage reads the reward as the reward stage wrote it, without the "
                "KL-in-reward term",
                "set algorithm.use_kl_loss: true (KL in the loss) or algorithm.kl_coef: 0",
            )
        )
    return out


def _check_groups(cfg: Config, spec: AlgorithmSpec) -> list[Violation]:
    """A group-relative estimator needs N >= 2 distinct responses per prompt."""
    a, out = cfg.algorithm, []
    if spec.needs_group_of_two:
        if cfg.rollout.n < 2:
            out.append(
                Violation(
                    "rollout.n",
                    cfg.rollout.n,
                    f"{a.name} compares each response with the other responses to its prompt; N=1 has none",
                    "set rollout.n >= 2",
                )
            )
        if cfg.rollout.temperature == 0 and cfg.rollout.n > 1:
            out.append(
                Violation(
                    "rollout.temperature",
                    0.0,
                    "greedy sampling gives N identical responses and zero advantages",
                    "set a temperature > 0, e.g. 1.0",
                )
            )
    return out


def _check_critic_fields(cfg: Config, spec: AlgorithmSpec) -> list[Violation]:
    """Critic fields only with a critic; a critic's own model folder must exist."""
    a, out = cfg.algorithm, []
    if not spec.critic:
        critic_only = {"lam", "value_clip", "critic_lr"} | (set() if spec.discounted else {"gamma"})
        for field in sorted(critic_only & a.model_fields_set):
            out.append(
                Violation(
                    f"algorithm.{field}",
                    getattr(a, field),
                    f"only PPO has a critic; algorithm.name is {a.name}",
                    "remove it or set algorithm.name: ppo",
                )
            )
        for field in sorted(cfg.critic.model_fields_set):
            out.append(
                Violation(
                    f"critic.{field}",
                    getattr(cfg.critic, field),
                    f"only PPO has a critic; algorithm.name is {a.name}",
                    "remove the critic section or set algorithm.name: ppo",
                )
            )
    elif cfg.critic.model_path is not None and not (Path(cfg.critic.model_path) / "config.json").is_file():
        out.append(
            Violation(
                "critic.model_path",
                cfg.critic.model_path,
                "no config.json in that folder",
                "point it at a local HF folder or leave it out (the actor's weights)",
            )
        )
    return out


def _check_objective_terms(cfg: Config, spec: AlgorithmSpec) -> list[Violation]:
    """KL loss, DAPO's overlong buffer and dynamic sampling, Dr. GRPO's undivided advantages."""
    a, out = cfg.algorithm, []
    if "use_kl_loss" in a.model_fields_set and a.kl_coef == 0:
        out.append(
            Violation(
                "algorithm.use_kl_loss",
                a.use_kl_loss,
                "there is no KL term: algorithm.kl_coef is 0",
                "set kl_coef > 0 or remove use_kl_loss",
            )
        )
    if spec.dapo and a.overlong_buffer >= cfg.rollout.max_response_length:
        out.append(
            Violation(
                "algorithm.overlong_buffer",
                a.overlong_buffer,
                f"not shorter than rollout.max_response_length={cfg.rollout.max_response_length}",
                "use a buffer smaller than the response length",
            )
        )
    if a.dynamic_sampling and not spec.dapo:
        out.append(
            Violation(
                "algorithm.dynamic_sampling",
                True,
                f"dynamic sampling is DAPO's; algorithm.name is {a.name}",
                "set algorithm.name: dapo or dynamic_sampling: false",
            )
        )
    if not a.norm_adv_by_std and not spec.std_normalised:  # asks for Dr. GRPO's undivided advantages
        out.append(
            Violation(
                "algorithm.norm_adv_by_std",
                False,
                f"only GRPO and DAPO divide by the group std; algorithm.name is {a.name}",
                "remove it",
            )
        )
    return out


def _check_correction(cfg: Config, spec: AlgorithmSpec) -> list[Violation]:
    """Rollout correction (TIS, IcePop, MIS bands) and DAPO's clip-higher."""
    out = []
    if cfg.actor.icepop_band is not None and cfg.actor.tis_cap is not None:
        out.append(
            Violation(
                "actor.tis_cap",
                cfg.actor.tis_cap,
                "IcePop's weight is already the importance ratio (inside its band); TIS would apply it twice",
                "remove actor.tis_cap with actor.icepop_band (or the band, to truncate instead of mask)",
            )
        )
    for field in ("icepop_band", "mis_band"):
        band = getattr(cfg.actor, field)
        if band is not None and not band[0] < 1.0 < band[1]:
            out.append(
                Violation(
                    f"actor.{field}",
                    list(band),
                    "the band must hold ratio 1 strictly inside ([low, high], low < 1 < high)",
                    "e.g. [0.5, 2.0]",
                )
            )
    if cfg.actor.clip_ratio_high < cfg.actor.clip_ratio_low and spec.dapo:
        out.append(
            Violation(
                "actor.clip_ratio_high",
                cfg.actor.clip_ratio_high,
                "DAPO's clip-higher needs clip_ratio_high >= clip_ratio_low",
                f"set it >= {cfg.actor.clip_ratio_low}, e.g. 0.28",
            )
        )
    return out


def _check_runtime(cfg: Config) -> list[Violation]:
    """Logging, launch and rendezvous, the dock's wire, evaluation, fusion and resume."""
    return _check_logging(cfg) + _check_launch(cfg) + _check_services(cfg)


def _check_logging(cfg: Config) -> list[Violation]:
    out: list[Violation] = []
    if (
        cfg.logging.wandb is not None
        and cfg.logging.wandb.mode != "disabled"
        and importlib.util.find_spec("wandb") is None
    ):
        out.append(
            Violation(
                "logging.wandb",
                cfg.logging.wandb.project,
                "the wandb package is not installed",
                "pip install 'spmd-rl[wandb]' (or wandb), or set logging.wandb.mode: disabled",
            )
        )
    return out


def _check_launch(cfg: Config) -> list[Violation]:
    """The elastic node range and the rendezvous endpoint."""
    out: list[Violation] = []
    e = cfg.elastic
    if e.min_nodes > e.max_nodes:
        out.append(
            Violation(
                "elastic.min_nodes",
                e.min_nodes,
                f"greater than elastic.max_nodes={e.max_nodes}",
                "make min_nodes <= max_nodes",
            )
        )
    elif not e.min_nodes <= cfg.parallel.nnodes <= e.max_nodes:
        out.append(
            Violation(
                "parallel.nnodes",
                cfg.parallel.nnodes,
                f"outside elastic range [{e.min_nodes}, {e.max_nodes}]",
                "widen elastic.min_nodes/max_nodes or change nnodes",
            )
        )
    if e.rdzv_backend == "etcd-v2" and not (e.rdzv_endpoint or cfg.metadata.endpoints):
        out.append(
            Violation(
                "elastic.rdzv_endpoint",
                None,
                "etcd-v2 rendezvous needs an etcd endpoint",
                "set elastic.rdzv_endpoint or metadata.endpoints",
            )
        )
    if e.rdzv_backend == "c10d" and e.max_nodes > 1 and not e.rdzv_endpoint:
        out.append(
            Violation(
                "elastic.rdzv_endpoint",
                None,
                f"c10d rendezvous over up to {e.max_nodes} nodes needs the host:port every node reaches",
                "set elastic.rdzv_endpoint (or use rdzv_backend: etcd-v2, which survives losing any node)",
            )
        )
    return out


def _check_services(cfg: Config) -> list[Violation]:
    """Metadata endpoints, the dock's message size and token, evaluation, fusion and resume."""
    out: list[Violation] = []
    for i, ep in enumerate(cfg.metadata.endpoints):
        if not _ENDPOINT.match(ep):
            out.append(Violation(f"metadata.endpoints.{i}", ep, "not host:port", "write endpoints like 10.0.0.1:2379"))
    if cfg.dock.max_message_bytes < cfg.dock.bucket_bytes + (1 << 20):
        out.append(
            Violation(
                "dock.max_message_bytes",
                cfg.dock.max_message_bytes,
                f"too small for a reply bucket of dock.bucket_bytes={cfg.dock.bucket_bytes} plus its header",
                f"make it at least bucket_bytes + 1 MiB = {cfg.dock.bucket_bytes + (1 << 20)}",
            )
        )
    if cfg.dock.token is not None and len(cfg.dock.token) < 16:
        out.append(
            Violation(
                "dock.token",
                "<hidden>",
                "shorter than 16 characters",
                "use a random token, e.g. `python -c 'import secrets;print(secrets.token_hex(16))'`",
            )
        )
    if cfg.trainer.eval_interval and not cfg.data.test_path:
        out.append(
            Violation(
                "trainer.eval_interval",
                cfg.trainer.eval_interval,
                "periodic evaluation needs held-out prompts",
                "set data.test_path or eval_interval: 0",
            )
        )
    if cfg.stream.fuse and not fused_stages(cfg, stages_for(cfg)):
        out.append(
            Violation(
                "stream.fuse",
                True,
                "no stage can run during generation: the reward needs the reward model and the advantage needs later "
                "stages' columns",
                "set stream.fuse: false, or use reward.kind: rule",
            )
        )
    res = cfg.checkpoint.resume
    if res not in ("auto", "never") and not Path(res).is_dir():
        out.append(
            Violation(
                "checkpoint.resume",
                res,
                "neither auto, never nor an existing checkpoint folder",
                "use auto, never or a checkpoint path",
            )
        )
    return out


def _check_relay(cfg: Config, lay: Layouts) -> list[Violation]:
    """``dock.tp_relay_min_bytes`` set to a size where no TP leader fetch can happen."""
    d = cfg.dock
    if "tp_relay_min_bytes" not in d.model_fields_set or d.tp_relay_min_bytes is None:
        return []
    if d.mode == "centralized":
        return [
            Violation(
                "dock.tp_relay_min_bytes",
                d.tp_relay_min_bytes,
                "the TP leader fetch relays through each node's own warehouse; dock.mode is centralized",
                "remove it, or set dock.mode: distributed",
            )
        ]
    if lay.train.tp == 1 and lay.gen.tp == 1:
        return [
            Violation(
                "dock.tp_relay_min_bytes",
                d.tp_relay_min_bytes,
                "there is no TP group to relay to: parallel.train.tp and parallel.gen.tp are 1",
                "remove it, or use tensor parallelism",
            )
        ]
    return []


def _check_records_groups(cfg: Config) -> list[Violation]:
    """``dock.records_group_nodes`` set where there is one warehouse only."""
    d = cfg.dock
    if "records_group_nodes" not in d.model_fields_set or d.mode != "centralized":
        return []
    return [
        Violation(
            "dock.records_group_nodes",
            d.records_group_nodes,
            "the centralized dock has one warehouse, whose records feed has nothing to group",
            "remove it, or set dock.mode: distributed",
        )
    ]


def _check_tls(cfg: Config) -> list[Violation]:
    m = cfg.metadata
    out = []
    if bool(m.cert_file) != bool(m.key_file):
        out.append(
            Violation(
                "metadata.cert_file" if m.key_file else "metadata.key_file",
                None,
                "a client certificate needs both files",
                "set metadata.cert_file and metadata.key_file (launch/make_certs.sh: client.crt, client.key)",
            )
        )
    if m.cert_file and not m.ca_file:
        out.append(
            Violation(
                "metadata.ca_file",
                None,
                "a client certificate is only used over TLS",
                "set metadata.ca_file to the etcd's CA (ca.crt)",
            )
        )
    for field in ("ca_file", "cert_file", "key_file"):
        path = getattr(m, field)
        if path and not Path(path).is_file():
            out.append(
                Violation(
                    f"metadata.{field}",
                    path,
                    "file not found",
                    "copy the job's certificates to this node (launch/make_certs.sh)",
                )
            )
    return out


def _check_rollout_engine(cfg: Config, lay: Layouts) -> list[Violation]:
    """A built-in engine must have every capability the run needs (``config.rollout_engines``);
    a user's ``module:Class`` is checked by the rank that builds it."""
    caps = ROLLOUTS.meta.get(cfg.rollout.engine)
    if caps is None:
        return []
    m = Modes.of(cfg)
    needs = {
        "adapters": cfg.actor.lora is not None and cfg.actor.lora.sync == "adapter",
        "routes": m.records_routes,
        "own_process": m.separated,
        "tensor_parallel": lay.gen.tp > 1,
    }
    return [
        Violation("rollout.engine", cfg.rollout.engine, f"the engine lacks {name}, which this run needs", note)
        for name, note in missing(caps, needs)
    ]


def check(cfg: Config, world: int | None = None, nproc_per_node: int | None = None) -> tuple[Layouts, list[Violation]]:
    """All cross-field violations of ``cfg`` for the given world size (default: the config's)."""
    lay, out = resolve_layouts(cfg, world, nproc_per_node)
    if bad := check_backend(cfg):  # every rule below reads the backend's entry
        return lay, out + bad
    if not out:
        out += _check_batches(cfg, lay)
    out += _check_model(cfg, lay)
    out += _check_files(cfg)
    out += _check_reward(cfg)
    out += _check_algorithm(cfg)
    out += _check_runtime(cfg)
    out += _check_relay(cfg, lay)
    out += _check_records_groups(cfg)
    out += _check_tls(cfg)
    out += _check_rollout_engine(cfg, lay)
    out += check_partial(cfg)
    out += check_separated(cfg)
    arch = _arch(cfg)
    out += train_backend(cfg).rules(cfg, arch, lay.train)
    out += check_router_replay(cfg, arch)
    out += check_gen_experts(cfg, arch, lay.gen)
    out += check_environment(cfg, lay.gen)
    out += check_dpo(cfg)
    out += check_replicas(cfg, lay)
    return lay, out


def _arch(cfg: Config) -> ModelArch | None:
    """The model's architecture, None when ``_check_model`` already reports it unreadable."""
    try:
        return ModelArch.from_folder(cfg.model.path)
    except (OSError, KeyError, ValueError):
        return None
