"""Rules of elastic replicas (``elastic.replicas``, ``spmd_rl.elastic.replicas``).

A lost replica's iteration is redone by the survivors from the state it started from: the
actor's and PPO's critic's, which the replica loop keeps when an iteration takes several
optimizer steps (``trainer.replica_loop.IterationStart``); no DPO (its pairs are not dealt). The
objective must be split-invariant across replicas with nothing but sums over them (each
mini-batch's normaliser, the whitening moments of REINFORCE++ and GAE:
``stages.advantage.batch_moments``),
and a fixed deal of prompt groups (no dynamic sampling, partial rollout or separated placement, whose
selections are the dock's and span the whole batch). Each mini-batch is dealt in units of
prompt groups, at least one per replica (``Replicas.deal``)."""

from __future__ import annotations

import ipaddress
import math

from spmd_rl.config.errors import Violation
from spmd_rl.config.layout import Layouts
from spmd_rl.config.schema import Config
from spmd_rl.recipe.graph import Modes, algorithm
from spmd_rl.recipe.train_backends import TRAIN_BACKENDS, train_backend


def deal_unit(lay: Layouts) -> int:
    """Prompt groups dealt to a replica at a time: its share splits evenly over both its DP layouts."""
    return math.lcm(lay.gen.dp, lay.train.dp)


def check_replicas(cfg: Config, lay: Layouts) -> list[Violation]:
    r = cfg.elastic.replicas
    if r is None:
        return []
    modes, field = Modes.of(cfg), "elastic.replicas"
    off = [
        (
            not train_backend(cfg).elastic_replicas,
            "actor.backend",
            cfg.actor.backend,
            "use a backend whose gradients are summed across replicas: "
            + ", ".join(n for n, b in sorted(TRAIN_BACKENDS.items()) if b.elastic_replicas),
        ),
        (
            algorithm(cfg).advantage == "preference",
            "algorithm.name",
            cfg.algorithm.name,
            "use a policy-gradient algorithm (grpo, rloo, reinforce_pp, ppo, ...): a preference objective's pairs "
            "are not dealt over replicas",
        ),
        (modes.dynamic_sampling, "algorithm.name", cfg.algorithm.name, "use grpo, or dapo without dynamic sampling"),
        (modes.partial_rollout, "stream.partial_tokens", cfg.stream.partial_tokens, "set it to 0"),
        (modes.separated, "parallel.placement", "separated", "use parallel.placement=colocated"),
    ]
    out = [
        Violation(name, value, f"not supported with {field}: a lost replica's iteration is redone from its start", fix)
        for bad, name, value, fix in off
        if bad
    ]
    if r.min_replicas > r.count:
        out.append(Violation(f"{field}.min_replicas", r.min_replicas, f"above {field}.count={r.count}", "lower it"))
    return out + _check_units(cfg, lay) + _check_network(cfg)


def _loopback(host: str) -> bool:
    host = host.removeprefix("https://").removeprefix("http://").strip("[]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _check_network(cfg: Config) -> list[Violation]:
    """Each replica's store (a generation's rendezvous) listens on ``dock.interface``: on loopback
    while etcd is elsewhere, other hosts cannot reach it (generations would form and break until
    ``QuorumLost``); off loopback, torch's store and gloo authenticate nobody, so the job needs
    etcd under TLS (whose member records say which addresses a generation trusts) and a
    network only its nodes reach (docs/operations.md, security model)."""
    hosts = [e.rpartition(":")[0] for e in cfg.metadata.endpoints]
    if _loopback(cfg.dock.interface):
        if any(h and not _loopback(h) for h in hosts):
            return [
                Violation(
                    "dock.interface",
                    cfg.dock.interface,
                    f"elastic.replicas on several hosts (etcd at {cfg.metadata.endpoints}) meet on each other's stores "
                    "at dock.interface, which other hosts cannot reach on loopback",
                    "set dock.interface to this node's address on the cluster's private network",
                )
            ]
        return []
    if cfg.metadata.ca_file is None:
        return [
            Violation(
                "dock.interface",
                cfg.dock.interface,
                "elastic.replicas' stores and gloo groups authenticate no peer: off loopback they need etcd under "
                "TLS and a private network",
                "set metadata.ca_file, cert_file and key_file (launch/make_certs.sh) and keep dock.interface on a "
                "network only the job's nodes reach",
            )
        ]
    return []


def _check_units(cfg: Config, lay: Layouts) -> list[Violation]:
    """Each mini-batch cuts into whole units, at least one per replica."""
    unit, mb, count = deal_unit(lay), cfg.actor.mini_batch_size, cfg.elastic.replicas.count
    if mb % unit:
        return [
            Violation(
                "actor.mini_batch_size",
                mb,
                f"elastic.replicas deals each mini-batch in units of {unit} prompt groups (the replica's DP sizes' "
                "lcm), and this is not a whole number of them",
                f"use a multiple of {unit}",
            )
        ]
    if mb // unit < count:
        return [
            Violation(
                "elastic.replicas.count",
                count,
                f"each mini-batch of {mb} prompt groups makes {mb // unit} units of {unit} (the replica's DP sizes' "
                "lcm), fewer than the replicas",
                f"use at most {mb // unit} replicas or a larger actor.mini_batch_size",
            )
        ]
    return []
