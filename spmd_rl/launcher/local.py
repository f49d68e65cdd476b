"""``spmd-rl train`` on one node: start the embedded etcd when ``metadata.endpoints`` is empty,
create the job token, run torchrun for this node, stop etcd at exit (also on failure).

Invariant: the launcher takes its whole tree with it. torchrun starts each worker in a new
session and nothing tells torchrun that the launcher died, so a SIGKILLed ``spmd-rl train``
used to leave torchrun, its workers and their vLLM engines running. An ``OrphanWatch`` holds
torchrun: when the launcher exits, however it dies, the watcher SIGKILLs torchrun and every
process below it (collected before the first kill) and unlinks the shared memory they mapped.
The embedded etcd dies with the launcher through PR_SET_PDEATHSIG.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

from spmd_rl.config.schema import Config
from spmd_rl.dock.etcd_server import EmbeddedEtcd
from spmd_rl.distributed.orphan_watch import OrphanWatch

GRACE_S = 30.0
"""Seconds torchrun gets after Ctrl-C to stop its workers before the watcher kills the tree."""


def rendezvous_args(cfg: Config) -> list[str]:
    """torchrun's rendezvous from ``elastic``: a standalone single node when the job cannot
    grow past one node on c10d; otherwise ``--nnodes MIN:MAX`` with the configured backend and
    endpoint (``elastic.rdzv_endpoint``, else the first etcd endpoint for etcd-v2) and last
    call (``elastic.rdzv_last_call_s``), over TLS for etcd-v2 when ``metadata.ca_file`` is set,
    keyed by
    ``metadata.job`` so every node of the job joins the same rendezvous."""
    e = cfg.elastic
    if e.rdzv_backend == "c10d" and e.max_nodes == 1:
        return ["--standalone", "--nnodes=1"]
    endpoint = e.rdzv_endpoint or cfg.metadata.endpoints[0]
    conf = f"last_call_timeout={e.rdzv_last_call_s:g}"
    m = cfg.metadata
    if e.rdzv_backend == "etcd-v2" and m.ca_file:  # the same TLS as the ranks' metadata connection
        conf += f",protocol=https,ca_cert={m.ca_file}" + (
            f",ssl_cert={m.cert_file},ssl_cert_key={m.key_file}" if m.cert_file else ""
        )
    return [
        f"--nnodes={e.min_nodes}:{e.max_nodes}",
        f"--rdzv-backend={e.rdzv_backend}",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={cfg.metadata.job}",
        f"--rdzv-conf={conf}",
    ]


def torchrun_command(config: Path, overrides: list[str], cfg: Config, nproc_per_node: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *rendezvous_args(cfg),
        f"--nproc-per-node={nproc_per_node}",
        f"--max-restarts={cfg.elastic.max_restarts}",
        "-m",
        "spmd_rl.train",
        str(config),
        *overrides,
    ]


def run_local(config: Path, overrides: list[str], cfg: Config, nproc_per_node: int) -> int:
    env = dict(os.environ)
    env.setdefault("SPMD_RL_JOB_TOKEN", cfg.dock.token or secrets.token_hex(16))
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault(
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1"
    )  # torch 2.13 hangs re-forming the group after a restart without it
    etcd = None
    try:
        if not cfg.metadata.endpoints and "SPMD_RL_ETCD" not in env:
            etcd = EmbeddedEtcd().start()
            env["SPMD_RL_ETCD"] = etcd.endpoint
            print(f"[spmd-rl] embedded etcd at {etcd.endpoint}", file=sys.stderr, flush=True)
        watch = OrphanWatch()
        with subprocess.Popen(torchrun_command(config, overrides, cfg, nproc_per_node), env=env) as torchrun:
            watch.watch({torchrun.pid})
            try:
                return torchrun.wait()
            except KeyboardInterrupt:  # Ctrl-C reached torchrun too: let it stop its workers first
                try:
                    torchrun.wait(timeout=GRACE_S)
                except subprocess.TimeoutExpired:
                    pass
                raise
            finally:
                watch.close()  # torchrun has exited (or this launcher is interrupted): nothing of it stays
    finally:
        if etcd is not None:
            etcd.stop()
