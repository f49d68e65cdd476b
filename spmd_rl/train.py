"""The torchrun entry point: ``python -m spmd_rl.train CONFIG [key=value ...]``.

Every rank runs this same program. It needs the job's etcd (``metadata.endpoints`` or
``$SPMD_RL_ETCD``, set by ``spmd-rl train``) and job token (``dock.token`` or
``$SPMD_RL_JOB_TOKEN``). Exit code 2 means a user error (config, data), printed as one line
per problem.
"""

from __future__ import annotations

from spmd_rl.engines.vllm.logs import QUIET_ENV
from spmd_rl.launcher.preload import delegate

delegate("spmd_rl.train", sets=QUIET_ENV)  # with a preload server: this process stands in for a copy past the imports

from spmd_rl.distributed.master_port import hold_master_port, release_master_port  # noqa: E402

MASTER_PORT_HOLD = hold_master_port()
"""Rank 0 reserves torchrun's MASTER_PORT before the seconds of imports below (master_port.py)."""

import datetime  # noqa: E402  (after the port is held)
import logging
from functools import partial
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from spmd_rl.catalog import user_function
from spmd_rl.config.errors import ConfigError, Violation
from spmd_rl.recipe.estimates import unsharded_accumulation_bytes
from spmd_rl.config.loader import load_config
from spmd_rl.config.model_arch import ModelArch
from spmd_rl.recipe.replica_rules import deal_unit
from spmd_rl.recipe.rules import check
from spmd_rl.recipe.graph import Modes, pinned_roles, stages_for
from spmd_rl.recipe.train_backends import train_backend
from spmd_rl.data.preferences import preferences_for
from spmd_rl.data.prompts import load_tokenizer, prompts_for
from spmd_rl.data.sampler import SamplerState, sampler_for
from spmd_rl.distributed import timeline
from spmd_rl.distributed.accelerator import detect
from spmd_rl.distributed.mesh import replica_group, train_mesh
from spmd_rl.distributed.sides import init_sides
from spmd_rl.distributed.timeouts import group_with_own_timeout, set_collective_timeout
from spmd_rl.distributed.teardown import exit_after
from spmd_rl.dock.client import TransferDock
from spmd_rl.dock.fetch import Peer
from spmd_rl.dock.columns import specs_of
from spmd_rl.recipe.columns import column_decls
from spmd_rl.dock.errors import DockUnavailable
from spmd_rl.dock.metadata import EtcdTLS, MetadataStore
from spmd_rl.elastic.quorum import NotAMember, QuorumLost
from spmd_rl.elastic.replica_group import ReplicaGroup
from spmd_rl.elastic.replicas import Replicas
from spmd_rl.elastic.replicated_step import sum_gradients
from spmd_rl.engines.lora import lora_modules
from spmd_rl.engines.base import Rollout, RolloutBuild
from spmd_rl.engines.rollouts import build_rollout_engine
from spmd_rl.engines.token_logprob import SamplingPolicy
from spmd_rl.engines.fsdp.engine import TrainEngine
from spmd_rl.engines.vllm.logs import quiet_vllm
from spmd_rl.reshard.allgather_swap import Resharder
from spmd_rl.reshard.residency import Residency
from spmd_rl.reshard.swap import resident_bytes
from spmd_rl.rewards import get_reward
from spmd_rl.trainer import checkpoint
from spmd_rl.trainer.context import HeldOut, Run
from spmd_rl.trainer.loop import train
from spmd_rl.trainer.ledger import PromptLedger
from spmd_rl.trainer.partial import restore_carry
from spmd_rl.trainer.replica_loop import join_running, trained
from spmd_rl.trainer.stages.minibatch import mini_batch_count

log = logging.getLogger("spmd_rl")


def _peer() -> Peer:
    npn = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    return Peer(
        rank,
        int(os.environ.get("WORLD_SIZE", 1)),
        int(os.environ.get("GROUP_RANK", rank // npn)),
        int(os.environ.get("LOCAL_RANK", 0)),
        npn,
    )


def _required(value: str | None, env: str, field: str, fix: str) -> str:
    got = value or os.environ.get(env)
    if not got:
        raise ConfigError([Violation(field, value, f"not set and ${env} is empty", fix)])
    return got


def build(cfg, peer: Peer) -> tuple[Run, int]:
    """Every rank: check the config, join the process group and the job's etcd and dock, build
    the rollout engine and the training roles, resume from the last checkpoint; returns the run
    and the first iteration to do."""
    lay, acc = _start(cfg, peer)
    endpoints, meta, token = _metadata(cfg, peer)
    modes = Modes.of(cfg)
    graph = stages_for(cfg)
    dock = TransferDock(cfg.dock, meta, specs_of(column_decls(graph)), peer, token).start(cfg.elastic.heartbeat_ttl_s)
    # separated placement: "gen" hosts only vLLM, "train" only the training roles
    side = init_sides(lay, peer.rank).side
    tok = load_tokenizer(cfg)
    prompts = (preferences_for if modes.algorithm.advantage == "preference" else prompts_for)(
        cfg, tok, cfg.data.train_path
    )
    generates = any("rollout" in s.roles for s in graph)  # DPO generates nothing
    rollout = build_rollout(cfg, modes, acc, lay, peer, side) if generates else None
    roles = build_roles(cfg, modes, acc, train_mesh(acc, lay.train), graph) if side != "gen" else {}
    check_accumulation_fits(cfg, acc, lay, roles)
    sampler = sampler_for(cfg, len(prompts))
    state, start = _resume(cfg, peer, roles, sampler)
    replicas, start = _replicas(cfg, endpoints, lay, roles, peer, sampler, start)
    run = Run(
        cfg=cfg,
        lay=lay,
        peer=peer,
        acc=acc,
        dock=dock,
        modes=modes,
        graph=graph,
        roles=roles,
        rollout=rollout,
        residency=Residency(
            Resharder(roles.get("actor"), rollout, cfg.reshard, cfg.model.dtype, acc), roles, pinned_roles(cfg)
        ),
        tokenizer=tok,
        prompts=prompts,
        sampler=sampler,
        reward_fn=get_reward(cfg.reward.rule, cfg.reward.format_score),
        lineage=checkpoint.lineage_id(state, cfg.checkpoint.resume),
        held_out=(
            HeldOut(prompts_for(cfg, tok, cfg.data.test_path), get_reward(cfg.reward.rule))
            if cfg.trainer.eval_interval and rollout is not None
            else None
        ),
        ledger=PromptLedger(_store(cfg, endpoints, f"{_dock_job(cfg)}.ledger")),
        # the TP ranks of a generation group run each multi-turn rollout together
        gen_tp_group=replica_group(lay.gen, peer.rank) if modes.multi_turn and lay.gen.tp > 1 else None,
        replicas=replicas,
    )
    if state is not None and "carry_rows" in state:
        restore_carry(run, state["carry_rows"])
    if peer.rank == 0:
        run.ledger.restart_at(start)  # the iterations from `start` on are (re)done from here
    dist.barrier()  # every rank has loaded and resumed: from here on, the steady-state timeout
    set_collective_timeout(cfg.elastic.collective_timeout_s)
    dock.watch_peers(_peer_lost)
    if peer.rank == 0:
        log.info("training from iteration %d with world %d", start, peer.world)
    return run, start


def _start(cfg, peer: Peer):
    """The checked layouts (exit 2 on a violation), this rank's accelerator, the process group
    (with the start-up timeout) and the seeds; returns (layouts, accelerator)."""
    lay, violations = check(cfg, peer.world, peer.nproc_per_node)
    if violations:
        raise ConfigError(violations)
    acc = detect(cfg.trainer.device, peer.local_rank)
    acc.set_device()
    timeline.use_device_events(acc.device)  # spans end when the device's work does
    release_master_port(MASTER_PORT_HOLD)
    dist.init_process_group(acc.backend, timeout=datetime.timedelta(seconds=cfg.elastic.startup_timeout_s))
    torch.manual_seed(cfg.trainer.seed)
    if cfg.trainer.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    return lay, acc


def _metadata(cfg, peer: Peer) -> tuple[list[str], MetadataStore, str]:
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
    meta = _store(cfg, endpoints, _dock_job(cfg))
    if peer.rank == 0:
        meta.delete_prefix(meta.key() + "/")
    dist.barrier()
    return endpoints, meta, token


def _store(cfg, endpoints: list[str], job: str) -> MetadataStore:
    """A client of the job's etcd under the namespace ``job``."""
    return MetadataStore(endpoints, job, cfg.metadata.retry_s, tls=EtcdTLS.of(cfg.metadata))


def _dock_job(cfg) -> str:
    """The job's namespace in etcd for its dock and ledger; each elastic replica has its own."""
    r = cfg.elastic.replicas
    return cfg.metadata.job if r is None else f"{cfg.metadata.job}.{r.name}"


def for_replica(cfg):
    """With ``elastic.replicas``: this replica's logs and checkpoints go under its name."""
    r = cfg.elastic.replicas
    if r is None:
        return cfg
    return cfg.model_copy(
        update={
            "logging": cfg.logging.model_copy(update={"dir": str(Path(cfg.logging.dir) / r.name)}),
            "checkpoint": cfg.checkpoint.model_copy(update={"dir": str(Path(cfg.checkpoint.dir) / r.name)}),
        }
    )


def _replica_local_group(cfg) -> dist.ProcessGroup:
    """The replica's own group for its lead's answers and its ranks' votes, with a timeout above
    the longest the lead may take (agreeing on a generation, ``elastic.startup_timeout_s``) plus
    a collective's (``timeout_s``): its other ranks wait in it meanwhile, and a timeout there is
    a crash, not the ``ReplicaLost`` or ``QuorumLost`` the lead's answer carries. Its timeout is
    its own: the phases' ``set_collective_timeout`` leaves it alone."""
    return group_with_own_timeout(cfg.elastic.startup_timeout_s + cfg.elastic.replicas.timeout_s + 60.0)


def _replica_layout(cfg, peer: Peer) -> dict:
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


def _replicas(cfg, endpoints: list[str], lay, roles: dict, peer: Peer, sampler, start: int) -> tuple:
    """With ``elastic.replicas``: (this replica's side, the first iteration to run). The first
    replicas wait for ``count`` of them; one arriving at a running job heals from a member
    instead (``trainer.replica_loop.join_running``: no checkpoint read) and starts where they
    are. The trained engines' gradients (the actor's, PPO's critic's) are summed over the
    replicas (``elastic.replicas``)."""
    r = cfg.elastic.replicas
    if r is None:
        return None, start
    group = ReplicaGroup(
        _store(cfg, endpoints, cfg.metadata.job),
        r.name,
        cfg.dock.interface,
        r.lease_s,
        r.join_window_s,
        r.min_replicas,
        r.timeout_s,
        local_pg=_replica_local_group(cfg) if peer.world > 1 else None,
        quorum_timeout_s=cfg.elastic.startup_timeout_s,
        layout=_replica_layout(cfg, peer),
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


def _resume(cfg, peer: Peer, roles: dict, sampler) -> tuple[dict | None, int]:
    """Load the last complete checkpoint (``checkpoint.resume``) into the roles, the sampler and
    the RNGs; returns (its trainer state, its iteration), or (None, 0) for a fresh start."""
    folder = checkpoint.resume_folder(cfg.checkpoint.dir, cfg.checkpoint.resume)
    if folder is None:
        return None, 0
    state = checkpoint.read_state(folder)
    for role in checkpoint.SAVED_ROLES:
        if role in roles:
            roles[role].load(checkpoint.role_folder(folder, role))
    sampler.state = SamplerState(**state["sampler"])
    checkpoint.set_rng_state(state["rng"])
    start = int(state["iteration"])
    if peer.rank == 0:
        log.info("resumed from %s at iteration %d", folder, start)
    return state, start


def build_rollout(cfg, modes: Modes, acc, lay, peer: Peer, side: str) -> Rollout | None:
    """The rollout engine ``rollout.engine`` names, built before every training role (vLLM's
    start-up check wants ``rollout.gpu_memory_utilization`` of the device free). A colocated engine starts from dummy
    weights (the first gather overwrites them) and sleeps at once, dropping them, so the
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
    """One engine per training-side role the graph uses (``Stage.roles``), FSDP2 over the
    training mesh or megatron-core (``actor.backend``): the actor always; the reference, PPO's critic (value head on the
    actor's or its own trunk, ``algorithm.critic_lr``) and the reward model when a stage needs them."""
    needed = {r for s in graph for r in s.roles}
    dtype = cfg.model.dtype
    engine = user_function(train_backend(cfg).engine, "actor.backend")  # the actor and the reference
    lm = partial(engine.from_config, cfg, acc, mesh, SamplingPolicy.of(cfg.rollout))
    roles = {"actor": lm(total_steps=_total_steps(cfg))}
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
    if "critic" in needed:
        critic_cfg = cfg.actor.model_copy(update={"lr": cfg.algorithm.critic_lr, "lora": None})
        roles["critic"] = TrainEngine(
            cfg.critic.model_path or cfg.model.path,
            acc,
            mesh,
            critic_cfg,
            dtype,
            total_steps=_total_steps(cfg),
            head="value",
        )
    if "reward_model" in needed:
        roles["reward_model"] = TrainEngine(
            cfg.reward.model_path, acc, mesh, cfg.actor, dtype, trainable=False, head="score"
        )
    return roles


PEER_LOST_EXIT = 75
"""Exit status of a rank that left because a peer was lost (EX_TEMPFAIL: torchrun restarts)."""


def _peer_lost(reason: str) -> None:
    """Leave at once, even from inside a collective: torchrun then re-forms the group."""
    log.error(
        "%s; exiting (status %d) so torchrun restarts the group from the latest checkpoint", reason, PEER_LOST_EXIT
    )
    logging.shutdown()
    sys.stderr.flush()
    os._exit(PEER_LOST_EXIT)


def _total_steps(cfg) -> int:
    return cfg.trainer.iterations * cfg.actor.ppo_epochs * mini_batch_count(cfg)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print("usage: python -m spmd_rl.train CONFIG [key=value ...]", file=sys.stderr)
        return 2
    peer = _peer()
    logging.basicConfig(
        level=logging.INFO if peer.rank == 0 else logging.WARNING,
        format=f"[rank{peer.rank}] %(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        cfg = for_replica(load_config(args[0], args[1:]))
        # a token given as an override must not reach what records the program's arguments
        # (W&B's run metadata): the config holds it now
        sys.argv = [a.split("=", 1)[0] + "=<redacted>" if a.startswith("dock.token=") else a for a in sys.argv]
        logging.getLogger().setLevel(cfg.logging.level if peer.rank == 0 else logging.WARNING)
        quiet_vllm(cfg.logging.dir, peer.rank)  # before vLLM is imported
        run, start = build(cfg, peer)
    except (ConfigError, ValueError) as exc:
        print(f"INVALID {exc}", file=sys.stderr)
        return 2
    except DockUnavailable as exc:  # etcd unreachable or refusing this rank: one line, not a traceback
        print(f"UNAVAILABLE {exc}", file=sys.stderr)
        return 1
    except QuorumLost as exc:  # a replica with no generation to join: torchrun may start it again
        print(f"UNAVAILABLE {exc}", file=sys.stderr)
        return PEER_LOST_EXIT
    try:
        train(run, start)
    except (DockUnavailable, QuorumLost) as exc:  # a warehouse lost before the peer watch saw it; too few replicas
        _peer_lost(str(exc))
    finally:
        if run.replicas is not None:
            run.replicas.close()
        run.dock.close()
    return 0


if __name__ == "__main__":
    exit_after(main)
