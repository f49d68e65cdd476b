"""Runtime rules: logging, the launch and its services, the dock's relay and record groups,
etcd TLS, and what the rollout engine can do (``logging.*``, ``elastic.*``, ``dock.*``,
``metadata.*``, ``rollout.engine``)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from spmd_rl.config.errors import Violation
from spmd_rl.config.layout import Layouts
from spmd_rl.config.rollout_engines import ROLLOUTS, missing
from spmd_rl.config.schema import Config
from spmd_rl.recipe.graph import Modes, fused_stages, stages_for


_ENDPOINT = re.compile(r"^(https?://)?[A-Za-z0-9_.\-\[\]:]+:\d{1,5}$")


def check_runtime(cfg: Config) -> list[Violation]:
    """Logging, launch and rendezvous, the dock's wire, evaluation, fusion and resume."""
    return check_logging(cfg) + check_launch(cfg) + check_services(cfg) + check_eval(cfg)


def check_logging(cfg: Config) -> list[Violation]:
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


def check_launch(cfg: Config) -> list[Violation]:
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


def check_services(cfg: Config) -> list[Violation]:
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


def check_relay(cfg: Config, lay: Layouts) -> list[Violation]:
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


def check_records_groups(cfg: Config) -> list[Violation]:
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


def check_tls(cfg: Config) -> list[Violation]:
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


def check_rollout_engine(cfg: Config, lay: Layouts) -> list[Violation]:
    """A built-in engine must have every capability the run needs (``config.rollout_engines``);
    a user's ``module:Class`` is checked by the rank that builds it. An engine's own settings
    (``RolloutCapabilities.settings``, e.g. ``rollout.vllm``) set for another engine are refused:
    nothing would read them."""
    caps = ROLLOUTS.meta.get(cfg.rollout.engine)
    out = [
        Violation(
            f"rollout.{section}.{field}",
            getattr(getattr(cfg.rollout, section), field),
            f"read only by the {section} engine; rollout.engine is {cfg.rollout.engine}",
            f"remove it, or set rollout.engine: {section}",
        )
        for section in sorted({c.settings for c in ROLLOUTS.meta.values() if c.settings})
        if caps is None or caps.settings != section
        for field in sorted(getattr(cfg.rollout, section).model_fields_set)
    ]
    if caps is None:
        return out
    m = Modes.of(cfg)
    needs = {
        "adapters": cfg.actor.lora is not None and cfg.actor.lora.sync == "adapter",
        "routes": m.records_routes,
        "own_process": m.separated,
        "tensor_parallel": lay.gen.tp > 1,
    }
    return out + [
        Violation("rollout.engine", cfg.rollout.engine, f"the engine lacks {name}, which this run needs", note)
        for name, note in missing(caps, needs)
    ]


def check_eval(cfg: Config) -> list[Violation]:
    """Held-out evaluation needs sets to evaluate and something to answer."""
    out: list[Violation] = []
    if cfg.eval.interval and not cfg.data.test_path:
        out.append(
            Violation(
                "eval.interval",
                cfg.eval.interval,
                "periodic evaluation needs held-out prompts",
                "set data.test_path or eval.interval: 0",
            )
        )
    if cfg.eval.interval and not cfg.eval.greedy and not cfg.eval.n:
        out.append(
            Violation(
                "eval.greedy",
                False,
                "with eval.n 0 the evaluation answers nothing",
                "set eval.greedy: true, or eval.n to the sampled answers per prompt",
            )
        )
    return out
