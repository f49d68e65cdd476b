"""The parts a rank builds before its first iteration, in the order ``trainer.trainer.Trainer``
calls them: the checked layouts and the process group, the job's etcd and dock, the rollout
engine, the training roles (``actor.backend``'s), a resume from the last checkpoint, and the
elastic replicas. Each is a function of the config sections it reads and what was built before.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist

from spmd_rl.catalog import user_function
from spmd_rl.config.errors import ConfigError, Violation
from spmd_rl.config.model_arch import ModelArch
from spmd_rl.config.runtime_schema import ElasticConfig, MetadataConfig
from spmd_rl.data.sampler import SamplerState
from spmd_rl.distributed import timeline
from spmd_rl.distributed.accelerator import detect
from spmd_rl.distributed.timeouts import group_with_own_timeout
from spmd_rl.dock.fetch import Peer
from spmd_rl.dock.metadata import EtcdTLS, MetadataStore
from spmd_rl.elastic.quorum import NotAMember
from spmd_rl.elastic.replica_group import ReplicaGroup
from spmd_rl.elastic.replicas import Replicas
from spmd_rl.elastic.replicated_step import sum_gradients
from spmd_rl.engines.base import Rollout, RolloutBuild
from spmd_rl.engines.training.lora import lora_modules
from spmd_rl.engines.rollouts import build_rollout_engine
from spmd_rl.engines.training.token_logprob import SamplingPolicy
from spmd_rl.recipe.estimates import unsharded_accumulation_bytes
from spmd_rl.recipe.graph import Modes, pinned_roles
from spmd_rl.recipe.replica_rules import deal_unit
from spmd_rl.recipe.rules import check
from spmd_rl.recipe.train_backends import train_backend
from spmd_rl.reshard.swap import resident_bytes
from spmd_rl.trainer import checkpoint
from spmd_rl.trainer.replica_loop import join_running, trained
from spmd_rl.trainer.stages.minibatch import mini_batch_count

log = logging.getLogger("spmd_rl")


def _required(value: str | None, env: str, field: str, fix: str) -> str:
    got = value or os.environ.get(env)
    if not got:
        raise ConfigError([Violation(field, value, f"not set and ${env} is empty", fix)])
    return got


def start_process_group(cfg, peer: Peer, before_init: Callable[[], None]):
    """The checked layouts (exit 2 on a violation), this rank's accelerator, the process group
    (with the start-up timeout) and the seeds; returns (layouts, accelerator). ``before_init``
    runs just before the process group forms (rank 0 lets go of torchrun's MASTER_PORT)."""
    lay, violations = check(cfg, peer.world, peer.nproc_per_node)
    if violations:
        raise ConfigError(violations)
    acc = detect(cfg.trainer.device, peer.local_rank)
    acc.set_device()
    timeline.use_device_events(acc.device)  # spans end when the device's work does
    before_init()
    dist.init_process_group(acc.backend, timeout=datetime.timedelta(seconds=cfg.elastic.startup_timeout_s))
    torch.manual_seed(cfg.trainer.seed)
    if cfg.trainer.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    return lay, acc


def metadata(cfg, peer: Peer) -> tuple[list[str], MetadataStore, str]:
    """(etcd endpoints, the job's metadata store, the job token). Rank 0 first discards the
    metadata of an unfinished iteration (restarts are iteration-atomic); every rank waits for it."""
    endpoint = _required(
        ",".join(cfg.metadata.endpoints),
        "SPMD_RL_ETCD",
        "metadata.endpoints",
        "launch with `spmd-rl train` (starts an embedded etcd) or set metadata.endpoints",
    )
    token = _required(
        cfg.dock.token, "SPMD_RL_JOB_TOKEN", "dock.token", "launch with `spmd-rl train` or set dock.token"
    )
    endpoints = endpoint.split(",")
    meta = store(cfg.metadata, endpoints, dock_job(cfg.metadata, cfg.elastic))
    if peer.rank == 0:
        meta.delete_prefix(meta.key() + "/")
    dist.barrier()
    return endpoints, meta, token


def store(metadata: MetadataConfig, endpoints: list[str], job: str) -> MetadataStore:
    """A client of the job's etcd under the namespace ``job``."""
    return MetadataStore(endpoints, job, metadata.retry_s, tls=EtcdTLS.of(metadata))


def dock_job(metadata: MetadataConfig, elastic: ElasticConfig, suffix: str = "") -> str:
    """The job's namespace in etcd for its dock (and with ``suffix`` ``.ledger``, its ledger);
    each elastic replica has its own."""
    r = elastic.replicas
    return (metadata.job if r is None else f"{metadata.job}.{r.name}") + suffix


def replica_local_group(elastic: ElasticConfig) -> dist.ProcessGroup:
    """The replica's own group for its lead's answers and its ranks' votes, with a timeout above
    the longest the lead may take (agreeing on a generation, ``elastic.startup_timeout_s``) plus
    a collective's (``timeout_s``): its other ranks wait in it meanwhile, and a timeout there is
    a crash, not the ``ReplicaLost`` or ``QuorumLost`` the lead's answer carries. Its timeout is
    its own: the phases' ``set_collective_timeout`` leaves it alone."""
    return group_with_own_timeout(elastic.startup_timeout_s + elastic.replicas.timeout_s + 60.0)


def replica_layout(cfg, peer: Peer) -> dict:
    """What every replica of a job must share: its ranks and layouts, the batch and its deal,
    the algorithm and the model's dtype (a heal copies tensors one by one, the deal cuts the
    same global batch)."""
    return {
        "ranks": peer.world,
        "parallel": cfg.parallel.model_dump(mode="json"),
        "actor.backend": cfg.actor.backend,
        "data.global_batch_size": cfg.data.global_batch_size,
        "actor.mini_batch_size": cfg.actor.mini_batch_size,
        "actor.ppo_epochs": cfg.actor.ppo_epochs,
        "rollout.n": cfg.rollout.n,
        "algorithm.name": cfg.algorithm.name,
        "model.dtype": cfg.model.dtype,
    }


def replicas_of(cfg, endpoints: list[str], lay, roles: dict, peer: Peer, sampler, start: int) -> tuple:
    """With ``elastic.replicas``: (this replica's side, the first iteration to run). The first
    replicas wait for ``count`` of them; one arriving at a running job heals from a member
    instead (``trainer.replica_loop.join_running``: no checkpoint read) and starts where they
    are. The trained engines' gradients (the actor's, PPO's critic's) are summed over the
    replicas (``elastic.replicas``)."""
    r = cfg.elastic.replicas
    if r is None:
        return None, start
    group = ReplicaGroup(
        store(cfg.metadata, endpoints, cfg.metadata.job),
        r.name,
        cfg.dock.interface,
        r.lease_s,
        r.join_window_s,
        r.min_replicas,
        r.timeout_s,
        local_pg=replica_local_group(cfg.elastic) if peer.world > 1 else None,
        quorum_timeout_s=cfg.elastic.startup_timeout_s,
        layout=replica_layout(cfg, peer),
        max_members=cfg.actor.mini_batch_size // deal_unit(lay),  # a unit of each mini-batch each
    )
    replicas = Replicas(group, cfg.data.global_batch_size, cfg.actor.mini_batch_size, deal_unit(lay))
    for engine in trained(roles):
        engine.gradient_sync = partial(sum_gradients, group)
    if group.running():
        start = join_running(replicas, trained(roles), sampler, start)
    else:
        try:
            replicas.start(r.count)
        except NotAMember:  # started with the first ones, after count of them formed generation 0: join
            start = join_running(replicas, trained(roles), sampler, start)
    if peer.rank == 0:
        log.info("replica %s: %d of %d replicas (generation %d)", r.name, group.rank, group.world, group.gen.number)
    return replicas, start


def resume(cfg, peer: Peer, roles: dict, sampler, group) -> tuple[dict | None, int]:
    """Load the last complete checkpoint (``checkpoint.resume``) into the roles, the sampler and
    the RNGs, collectively over ``group`` (the training side); returns (its trainer state, its
    iteration), or (None, 0) for a fresh start."""
    folder = checkpoint.resume_folder(cfg.checkpoint.dir, cfg.checkpoint.resume)
    if folder is None:
        return None, 0
    state = checkpoint.read_state(folder)
    for role in checkpoint.SAVED_ROLES:
        if role in roles:
            roles[role].load(checkpoint.role_folder(folder, role), group)
    sampler.state = SamplerState(**state["sampler"])
    checkpoint.set_rng_state(state["rng"])
    start = int(state["iteration"])
    if peer.rank == 0:
        log.info("resumed from %s at iteration %d", folder, start)
    return state, start


def build_rollout(cfg, modes: Modes, acc, lay, peer: Peer, side: str) -> Rollout | None:
    """The rollout engine ``rollout.engine`` names, built before every training role (vLLM's
    start-up check wants ``rollout.vllm.gpu_memory_utilization`` of the device free). A colocated
    engine starts from dummy weights (the first gather overwrites them) and sleeps at once, dropping them, so the
    training roles load into a free device."""
    if side == "train":
        return None
    colocated = side == "both"
    max_len = cfg.data.max_prompt_length + cfg.rollout.max_response_length
    rollout = build_rollout_engine(
        RolloutBuild(
            cfg.model.path,
            acc,
            cfg.rollout,
            lay.gen.tp,
            cfg.model.dtype,
            max_len,
            cfg.trainer.seed,
            distributed=peer.world > 1 and colocated,
            own_process=side == "gen",
            dummy_weights=colocated,
            record_routes=modes.records_routes,
            expert_parallel=cfg.parallel.gen.expert_parallel,
            lora=cfg.actor.lora if cfg.actor.lora is not None and cfg.actor.lora.sync == "adapter" else None,
        )
    )
    if colocated:
        rollout.sleep(discard_weights=True)
    return rollout


def check_accumulation_fits(cfg, acc, lay, roles: dict) -> None:
    """On a device, refuse ``actor.accumulate_unsharded`` when its unsharded parameters and
    float32 gradients (``recipe.estimates.unsharded_accumulation_bytes``) exceed what the update
    will have free: the free device memory now plus the roles that leave for host before it."""
    if not cfg.actor.accumulate_unsharded or "actor" not in roles or (free := acc.device_free_bytes()) is None:
        return
    leaving = sum(
        resident_bytes(e.param_tensors()) for r, e in roles.items() if r != "actor" and r not in pinned_roles(cfg)
    )
    need = unsharded_accumulation_bytes(ModelArch.from_folder(cfg.model.path), lay, cfg.model.dtype)
    if need > free + leaving:
        raise ConfigError(
            [
                Violation(
                    "actor.accumulate_unsharded",
                    True,
                    f"needs {need / 2**30:.2f} GiB per rank during the update; about {(free + leaving) / 2**30:.2f} "
                    f"GiB will be free",
                    "set actor.accumulate_unsharded=false, or shard over more ranks (parallel.train.dp_shard)",
                )
            ]
        )


def build_roles(cfg, modes: Modes, acc, mesh, graph) -> dict:
    """One engine per training-side role the graph uses (``Stage.roles``), each built by the
    backend ``actor.backend`` names over the training mesh (``recipe.train_backends``): the
    actor always; the reference, PPO's critic and the reward model when a stage needs them."""
    needed = {r for s in graph for r in s.roles}
    backend = train_backend(cfg)
    engine = user_function(backend.engine, "actor.backend")  # the actor and the reference
    lm = partial(engine.from_config, cfg, acc, mesh, SamplingPolicy.of(cfg.rollout))
    roles = {"actor": lm(total_steps=total_steps(cfg))}
    if cfg.actor.lora is not None:
        adapted = len(list(lora_modules(roles["actor"].model)))
        sync = (
            "the adapters alone to vLLM's LoRA (the base weights loaded once)"
            if cfg.actor.lora.sync == "adapter"
            else "merged weights W + (alpha/r) B A through allgather-swap"
        )
        log.info(
            "actor: LoRA rank %d alpha %g on %d layers (%s); weight sync: %s",
            cfg.actor.lora.rank,
            cfg.actor.lora.alpha,
            adapted,
            ", ".join(cfg.actor.lora.target_modules),
            sync,
        )
    if cfg.actor.lora is not None and modes.needs_reference:
        # the base model with adapters off (its stage makes the actor resident)
        roles["ref"] = roles["actor"].reference()
    elif "ref" in needed:
        roles["ref"] = lm(trainable=False)
    for role in sorted(needed & backend.roles.keys()):  # validate refused a needed role it lacks
        roles[role] = user_function(backend.roles[role], "actor.backend")(cfg, acc, mesh, total_steps(cfg))
    return roles


PEER_LOST_EXIT = 75
"""Exit status of a rank that left because a peer was lost (EX_TEMPFAIL: torchrun restarts)."""


def peer_lost(reason: str) -> None:
    """Leave at once, even from inside a collective: torchrun then re-forms the group."""
    log.error(
        "%s; exiting (status %d) so torchrun restarts the group from the latest checkpoint", reason, PEER_LOST_EXIT
    )
    logging.shutdown()
    sys.stderr.flush()
    os._exit(PEER_LOST_EXIT)


def total_steps(cfg) -> int:
    return cfg.trainer.iterations * cfg.actor.ppo_epochs * mini_batch_count(cfg)
