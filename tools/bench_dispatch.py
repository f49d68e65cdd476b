#!/usr/bin/env python
"""Sample-flow dispatch benchmark: distributed transfer dock vs centralized buffer, same run.

One iteration's sample flow with the traffic pattern behind the paper's Eq. (2): per sample the
prompt (PL tokens) is written once and read once, each of n response-length items (SL) is
written once and read twice, and M scalars are written once and read seven times, so one
iteration moves G x N x B x (2PL + 3n x SL + 8M) bytes through the dock. S simulated nodes
(one torchrun agent and, by default, one rank each): every rank writes, training DP = S reads.

With ``--nproc-per-node K --train-tp T`` each node runs K ranks and the readers are DP groups of
T TP ranks (a TP group never spans nodes). ``--writer-nodes W`` lets only the first W nodes'
ranks write, as the generation nodes of a separated placement do, so the other nodes' DP groups
read their whole share from another node; ``--long-tail`` draws each sample's response length
from [SL/16, SL], so the token balance sends part of a share from other nodes. A ``-norelay``
mode suffix turns off the TP leader fetch (``dock.tp_relay_min_bytes: null``, its baseline;
``--relay-min-bytes`` sets the field for the other modes). Relayed shares add their bytes to the
reading node's warehouse (in and out) beyond Eq. (4), and ``--long-tail`` moves fewer bytes
than Eq. (4)'s fixed SL counts.

Printed per mode: wall time of the dispatch (slowest rank; median of the steady iterations
after a cold first one, which also opens the connections), payload bytes through each
warehouse (in + out) against Eq. (4) (distributed: total / S) or Eq. (2) (centralized: all of
it through one), and the ratio centralized / distributed measured in this run.

    python tools/bench_dispatch.py --nodes 4                      # loopback, no limit
    sudo python tools/bench_dispatch.py --nodes 4 --netns --rate-mbs 50   # namespaces + tc tbf
    sudo python tools/bench_dispatch.py --nodes 4 --nproc-per-node 2 --train-tp 2 --writer-nodes 1 \
        --netns --rate-mbs 300 --modes distributed-norelay,distributed   # TP leader fetch
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

B = 4  # bytes per token id / float32 value, as in the paper
SUBNET = "10.77.0"
BRIDGE = "br-spmdrl"


def flow_columns(n: int, m: int) -> tuple[list[str], list[str]]:
    return [f"item{k}" for k in range(n)], [f"scalar{k}" for k in range(m)]


# ----------------------------------------------------------------------------- worker (a rank)
def worker(spec: dict) -> None:
    import torch
    import torch.distributed as dist

    from spmd_rl.config.layout import Layout
    from spmd_rl.config.schema import DockConfig
    from spmd_rl.dock.client import TransferDock
    from spmd_rl.dock.fetch import Peer
    from spmd_rl.dock.columns import ColumnSpec
    from spmd_rl.dock.metadata import MetadataStore

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    G, N, PL, SL, n, m = (spec[k] for k in ("G", "N", "PL", "SL", "n", "M"))
    items, scalars = flow_columns(n, m)
    specs = {"prompt_ids": ColumnSpec("prompt_ids", torch.int32, True, "data")}
    specs |= {c: ColumnSpec(c, torch.float32, True, "rollout") for c in items}
    specs |= {c: ColumnSpec(c, torch.float32, False, "rollout") for c in scalars}
    mode = spec["mode"].removesuffix("-norelay")
    cfg = DockConfig(
        mode=mode.removesuffix("-wire"),
        interface=os.environ.get("BENCH_INTERFACE", "127.0.0.1"),
        port=0,
        get_timeout_s=600,
        bucket_bytes=8 << 20,
        tp_relay_min_bytes=None if spec["mode"].endswith("-norelay") else spec["relay_min_bytes"],
    )
    meta = MetadataStore([spec["etcd"]], job=f"bench-{spec['mode']}-{spec['tag']}")
    peer = Peer(
        rank, world, int(os.environ["GROUP_RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    )
    dock = TransferDock(cfg, meta, specs, peer, spec["token"], in_process=not mode.endswith("-wire")).start()
    lay = Layout(world // spec["tp"], spec["tp"])
    total = G * N
    writers = spec["writer_nodes"] * peer.nproc_per_node  # the first ranks, node by node
    per = total // writers
    mine = list(range(rank * per, (rank + 1) * per)) if rank < writers else []
    g = torch.Generator().manual_seed(rank)
    data = {"prompt_ids": [torch.randint(0, 1000, (PL,), generator=g, dtype=torch.int32) for _ in mine]}
    lengths = (
        torch.randint(max(1, SL // 16), SL + 1, (len(mine),), generator=g).tolist()
        if spec["long_tail"]
        else [SL] * len(mine)
    )
    data |= {c: [torch.randn(k, generator=g) for k in lengths] for c in items}
    data |= {c: torch.randn(len(mine), generator=g) for c in scalars}
    times = []
    for it in range(spec["iterations"]):  # the first is cold (connections, etcd clients); the rest are steady
        dock.begin_iteration(it, total)
        dist.barrier()
        t0 = time.perf_counter()
        if mine:
            dock.put("rollout", it, data, mine)
        dock.get("reader_a", it, ["prompt_ids", *items, *scalars], lay)
        dock.get("reader_b", it, [*items, *scalars], lay)
        for k in range(5):
            dock.get(f"reader_s{k}", it, scalars, lay)
        dist.barrier()
        times.append(time.perf_counter() - t0)
        dock.commit(it)
    st = dock.warehouse_stats() if dock.server is not None else None  # cumulative over the iterations
    row = torch.tensor([*times, st["bytes_in"] if st else -1, st["bytes_out"] if st else -1], dtype=torch.float64)
    rows = [torch.zeros_like(row) for _ in range(world)]
    dist.all_gather(rows, row)
    if rank == 0:
        Path(spec["out"]).write_text(json.dumps([r.tolist() for r in rows]))
    dist.barrier()
    dock.close()


# ----------------------------------------------------------------------------- network namespaces
def sh(cmd: str) -> None:
    subprocess.run(cmd, shell=True, check=True)


def netns_up(nodes: int, rate_mbs: float) -> list[str]:
    """One namespace per node on a bridge, tc tbf on both ends of each veth (ingress and egress
    of the node limited to ``rate_mbs`` MB/s). Returns the node addresses."""
    netns_down(nodes)
    sh(f"ip link add {BRIDGE} type bridge && ip addr add {SUBNET}.1/24 dev {BRIDGE} && ip link set {BRIDGE} up")
    rate = f"{int(rate_mbs * 8)}mbit"
    burst = max(
        256 << 10, int(rate_mbs * 1e6 / 50)
    )  # tbf passes at most one burst per timer tick: keep it above rate / HZ
    addrs = []
    for k in range(nodes):
        ns, host, peer, ip = f"spmdrl{k}", f"vh{k}spmd", f"vn{k}spmd", f"{SUBNET}.{10 + k}"
        sh(f"ip netns add {ns} && ip link add {host} type veth peer name {peer} && ip link set {peer} netns {ns}")
        sh(f"ip link set {host} master {BRIDGE} && ip link set {host} up")
        sh(
            f"ip netns exec {ns} ip addr add {ip}/24 dev {peer} && ip netns exec {ns} ip link set {peer} up && ip "
            f"netns exec {ns} ip link set lo up"
        )
        sh(f"ip netns exec {ns} ip route add default via {SUBNET}.1")
        for dev, prefix in ((peer, f"ip netns exec {ns} "), (host, "")):
            sh(f"{prefix}tc qdisc add dev {dev} root tbf rate {rate} burst {burst} latency 100ms")
        addrs.append(ip)
    return addrs


def netns_down(nodes: int) -> None:
    for k in range(nodes):
        subprocess.run(f"ip netns del spmdrl{k}", shell=True, stderr=subprocess.DEVNULL)
        subprocess.run(f"ip link del vh{k}spmd", shell=True, stderr=subprocess.DEVNULL)
    subprocess.run(f"ip link del {BRIDGE}", shell=True, stderr=subprocess.DEVNULL)


# ----------------------------------------------------------------------------- driver
def python_path() -> str:
    """The caller's PYTHONPATH with the repository on it (unchanged when it is: a preload server
    forks a worker only when its environment is the server's, ``launcher.preload``)."""
    entries = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    return os.environ["PYTHONPATH"] if str(REPO) in entries else os.pathsep.join(filter(None, [str(REPO), *entries]))


def run_mode(mode: str, args, etcd_endpoint: str, addrs: list[str] | None, tmp: Path, tag: int) -> dict:
    from spmd_rl.dock.etcd_server import free_port

    out = tmp / f"{mode}.json"
    spec = {
        "mode": mode,
        "etcd": etcd_endpoint,
        "out": str(out),
        "token": "bench-token-0123456789abcdef",
        "tag": tag,
        "iterations": args.iterations,
        "G": args.G,
        "N": args.N,
        "PL": args.PL,
        "SL": args.SL,
        "n": args.n,
        "M": args.M,
        "tp": args.train_tp,
        "long_tail": args.long_tail,
        "relay_min_bytes": args.relay_min_bytes,
        "writer_nodes": args.writer_nodes or args.nodes,
    }
    master = addrs[0] if addrs else "127.0.0.1"
    port = free_port("127.0.0.1")
    procs = []
    for k in range(args.nodes):
        env = dict(
            os.environ,
            OMP_NUM_THREADS="1",
            PYTHONPATH=python_path(),
            BENCH_INTERFACE=addrs[k] if addrs else "127.0.0.1",
        )
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={args.nodes}",
            f"--node-rank={k}",
            f"--nproc-per-node={args.nproc_per_node}",
            f"--master-addr={master}",
            f"--master-port={port}",
            str(Path(__file__).resolve()),
            "--worker",
            json.dumps(spec),
        ]
        if addrs:
            cmd = ["ip", "netns", "exec", f"spmdrl{k}"] + cmd
            env["GLOO_SOCKET_IFNAME"] = f"vn{k}spmd"  # else gloo resolves the hostname to loopback
        procs.append(
            subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=open(tmp / f"{mode}{k}.log", "w"))
        )
    codes = [p.wait(timeout=args.timeout) for p in procs]
    if any(codes):
        raise SystemExit(f"{mode}: agents exited {codes}; logs in {tmp}")
    rows = json.loads(out.read_text())
    per_iter = [max(r[i] for r in rows) for i in range(args.iterations)]  # the slowest rank of each iteration
    steady = sorted(per_iter[1:]) or per_iter
    return {
        "cold": per_iter[0],
        "time": steady[len(steady) // 2],
        "iterations": per_iter,
        "warehouse_bytes": {k: (r[-2] + r[-1]) / args.iterations for k, r in enumerate(rows) if r[-2] >= 0},
    }


def main() -> None:  # noqa: PLR0915
    from spmd_rl.config.schema import DockConfig

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=4, help="S simulated nodes.")
    ap.add_argument(
        "--nproc-per-node", type=int, default=1, help="Ranks per node (each writes 1/world of the samples)."
    )
    ap.add_argument(
        "--train-tp", type=int, default=1, help="TP size of the reading layout; must divide --nproc-per-node."
    )
    ap.add_argument(
        "--relay-min-bytes",
        type=int,
        default=DockConfig.model_fields["tp_relay_min_bytes"].default,
        help="dock.tp_relay_min_bytes of the modes without -norelay (default: the field's default).",
    )
    ap.add_argument(
        "--writer-nodes",
        type=int,
        default=None,
        help="Only the first K nodes' ranks write (separated placement's generation nodes); default: every node.",
    )
    ap.add_argument(
        "--long-tail", action="store_true", help="Response lengths drawn from [SL/16, SL] instead of all SL."
    )
    ap.add_argument("--G", type=int, default=32)
    ap.add_argument("--N", type=int, default=8)
    ap.add_argument("--PL", type=int, default=256)
    ap.add_argument("--SL", type=int, default=1024)
    ap.add_argument("--n", type=int, default=5, help="Response-length items per sample.")
    ap.add_argument("--M", type=int, default=3, help="Scalars per sample.")
    ap.add_argument(
        "--modes",
        default="centralized,distributed-wire,distributed",
        help="centralized | distributed; a -wire suffix sends the serving rank's own requests over the wire too "
        "(no in-process path, dock.local: the baseline of that lever); -norelay: no TP leader fetch",
    )
    ap.add_argument("--netns", action="store_true", help="One network namespace per node with tc tbf limits (root).")
    ap.add_argument("--rate-mbs", type=float, default=50.0, help="Per-node link limit in MB/s with --netns.")
    ap.add_argument(
        "--iterations",
        type=int,
        default=4,
        help="Iterations per mode; the time is the median of all but the first (cold) one.",
    )
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--json", default=None, help="Also write the results to this JSON file.")
    args = ap.parse_args()
    if not 0 < (args.writer_nodes or args.nodes) <= args.nodes:
        raise SystemExit("--writer-nodes must be between 1 and --nodes")
    if (args.G * args.N) % ((args.writer_nodes or args.nodes) * args.nproc_per_node):
        raise SystemExit("G x N must be divisible by the writing ranks (--writer-nodes or --nodes, x --nproc-per-node)")
    if args.nproc_per_node % args.train_tp:
        raise SystemExit("--train-tp must divide --nproc-per-node (a TP group stays within a node)")

    from spmd_rl.recipe.estimates import tcv_centralized, tcv_per_warehouse
    from spmd_rl.dock.etcd_server import EmbeddedEtcd

    addrs = netns_up(args.nodes, args.rate_mbs) if args.netns else None
    host = f"{SUBNET}.1" if addrs else "127.0.0.1"
    try:
        with EmbeddedEtcd(host=host) as etcd, tempfile.TemporaryDirectory() as tmp:
            results = {
                m: run_mode(m, args, etcd.endpoint, addrs, Path(tmp), tag)
                for tag, m in enumerate(args.modes.split(","))
            }
    finally:
        if args.netns:
            netns_down(args.nodes)

    GB = 1024**3
    c = 2 + 5  # controllers of this flow: writer + 7 reading stages (the paper's C)
    eq2 = tcv_centralized(args.G, args.N, B, args.PL, args.SL, args.n, args.M) * GB
    eq4 = tcv_per_warehouse(args.G, args.N, B, args.PL, args.SL, args.n, args.M, C=0, S=args.nodes) * GB
    eq4_meta = tcv_per_warehouse(args.G, args.N, B, args.PL, args.SL, args.n, args.M, C=c, S=args.nodes) * GB
    link = f"netns, {args.rate_mbs:g} MB/s per node link" if args.netns else "loopback, no limit"
    print(f"G={args.G} N={args.N} PL={args.PL} SL={args.SL} n={args.n} M={args.M} S={args.nodes} ({link})")
    print(
        f"Eq. (2) total {eq2 / 2**20:.2f} MiB; Eq. (4) per warehouse {eq4_meta / 2**20:.3f} MiB "
        f"(data part {eq4 / 2**20:.3f} MiB; the 8(C+1)M metadata part goes to etcd here)"
    )
    for mode, r in results.items():
        expect = eq4 if mode.startswith("distributed") else eq2
        full = eq4_meta if mode.startswith("distributed") else eq2
        per = ", ".join(
            f"node{k} {b / 2**20:.3f} MiB ({(b - expect) / expect * 100:+.2f}% data, {(b - full) / full * 100:+.2f}% "
            f"full eq.)"
            for k, b in r["warehouse_bytes"].items()
        )
        print(f"  {mode:16s} dispatch {r['time']:7.3f} s (steady median; cold {r['cold']:.3f} s)   warehouses: {per}")
    for mode in (m for m in results if m.startswith("distributed") and "centralized" in results):
        print(
            f"  ratio centralized / {mode} dispatch time: {results['centralized']['time'] / results[mode]['time']:.2f}x"
        )
    for mode in (m for m in results if m.endswith("-norelay") and m.removesuffix("-norelay") in results):
        print(
            f"  ratio {mode} / {mode.removesuffix('-norelay')} dispatch time (TP leader fetch): "
            f"{results[mode]['time'] / results[mode.removesuffix('-norelay')]['time']:.2f}x"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        from spmd_rl.engines.vllm.logs import QUIET_ENV
        from spmd_rl.launcher.preload import delegate

        delegate(sets=QUIET_ENV)  # with a preload server (the test suite's): forked past the imports
        from spmd_rl.distributed.teardown import exit_after

        exit_after(lambda: worker(json.loads(sys.argv[2])))
    else:
        main()
