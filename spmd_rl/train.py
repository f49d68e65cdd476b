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

import logging  # noqa: E402  (after the port is held)
import os
import sys
from functools import partial
from pathlib import Path

from spmd_rl.config.errors import ConfigError
from spmd_rl.config.loader import load_config
from spmd_rl.distributed.teardown import exit_after
from spmd_rl.dock.errors import DockUnavailable
from spmd_rl.dock.fetch import Peer
from spmd_rl.elastic.quorum import QuorumLost
from spmd_rl.engines.vllm.logs import quiet_vllm
from spmd_rl.trainer.build import PEER_LOST_EXIT, peer_lost
from spmd_rl.trainer.trainer import Trainer


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
        trainer = Trainer(cfg, peer, partial(release_master_port, MASTER_PORT_HOLD))
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
        trainer.train()
    except (DockUnavailable, QuorumLost) as exc:  # a warehouse lost before the peer watch saw it; too few replicas
        peer_lost(str(exc))
    finally:
        trainer.close()
    return 0


if __name__ == "__main__":
    exit_after(main)
