#!/usr/bin/env python
"""The dock's control plane at scale: etcd operations, dispatch latency and warehouse bytes for
S simulated nodes x K ranks, without models (issue [6/6]).

Every rank runs the real dock (``TransferDock``: warehouse on each node's local rank 0, put
records and controllers in etcd, liveness leases, the peer watch) against one real etcd and
walks the real stage graph of a GRPO run with a reference (``recipe.graph.stages_for`` of
``configs/paper_qwen25_32b.yaml``): the data loader's put of the prompts, then per stage a get of
its declared inputs in its own layout (generation TP ``--gen-tp`` for the rollout, training DP
for the rest) and, on the stage's writers, a put of its declared outputs as synthetic columns
(response-length columns of ``--SL`` values, prompts of ``--PL``). A node is one process forked
from this one (its imports paid once); its K ranks are threads, so 256 ranks fit on 2 cores.
Ranks meet at the iteration boundary in a process-shared barrier (the trainer's gloo barrier
before ``commit``), which touches no etcd.

Measured per S, on the iterations after the first (which opens the connections):
- etcd operations by kind, counted twice: by the ranks' clients (``MetadataStore`` calls,
  split into dispatch (the rank's own thread), liveness (heartbeat and peer-watch threads)
  and watches), and by etcd itself (its ``/metrics``: gRPC calls handled per method). The
  two must agree; the test checks it;
- per rank and iteration: dispatch reads and writes; in the background, per rank and second:
  lease keep-alives and liveness reads;
- bytes etcd sent to clients per iteration;
- a stage's dispatch (first rank's get to the last rank's put, median over iterations) and
  every rank's get latency p50/p99;
- the time ranks spent inside etcd calls as a share of their dock time;
- payload bytes through each warehouse against Eq. (4).

``--fit`` fits per-rank costs (keep-alives: per node) to the points, extrapolates to 1,024 and
4,096 ranks at the paper's iteration time (``--iteration-s``) and sets them against etcd's
capacity measured on this machine (``--capacity``: small puts and range reads from many clients, etcd with fsync).

    python tools/bench_control_plane.py --nodes 4,8,16 --fit --capacity
    python tools/bench_control_plane.py --nodes 4,8,16,32,64 --fit --capacity --json out.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import queue as queue_mod
import re
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from etcd3gw.lease import Lease  # noqa: E402

from spmd_rl.config.layout import Layout  # noqa: E402
from spmd_rl.config.loader import load_config  # noqa: E402
from spmd_rl.config.schema import DockConfig  # noqa: E402
from spmd_rl.dock.client import TransferDock  # noqa: E402
from spmd_rl.dock.columns import specs_of  # noqa: E402
from spmd_rl.recipe.columns import column_decls  # noqa: E402
from spmd_rl.recipe.graph import COLUMNS  # noqa: E402
from spmd_rl.dock.etcd_server import EmbeddedEtcd  # noqa: E402
from spmd_rl.dock.fetch import Peer  # noqa: E402
from spmd_rl.dock.metadata import MetadataStore  # noqa: E402
from spmd_rl.recipe.estimates import GB, tcv_per_warehouse  # noqa: E402
from spmd_rl.recipe.graph import flow_counts, stages_for  # noqa: E402

PAPER_CONFIG = REPO / "configs" / "paper_qwen25_32b.yaml"
TOKEN = "bench-control-plane-token-0123456789"
SERVER_METHODS = {
    "Range": "reads",
    "Put": "writes",
    "DeleteRange": "writes",
    "Txn": "writes",
    "LeaseGrant": "writes",
}
CLIENT_KIND = {  # MetadataStore method -> (what etcd serves it as, read or write)
    "get": "reads",
    "get_prefix": "reads",
    "get_prefix_at": "reads",
    "put": "writes",
    "delete": "writes",
    "delete_prefix": "writes",
    "create": "writes",
    "replace": "writes",
    "lease": "writes",
    "watch_prefix": "watches",
}


# ----------------------------------------------------------------------------- etcd's own counts
def etcd_counters(endpoint: str) -> Counter:
    """etcd's cumulative counts from its ``/metrics``: gRPC calls handled by kind (reads,
    writes), watch streams opened, lease keep-alives, bytes sent to clients, its CPU seconds."""
    text = urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10).read().decode()
    out: Counter = Counter()
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith("grpc_server_handled_total{"):
            method = re.search(r'grpc_method="(\w+)"', name).group(1)
            if method in SERVER_METHODS:
                out[SERVER_METHODS[method]] += float(value)
        elif name.startswith("grpc_server_started_total{") and 'grpc_method="Watch"' in name:
            out["watches"] += float(value)
        elif name == "etcd_debugging_mvcc_events_total":
            out["watch_events"] += float(value)
        elif name == "etcd_debugging_lease_renewed_total":
            out["keepalives"] += float(value)
        elif name == "etcd_network_client_grpc_sent_bytes_total":
            out["sent_bytes"] += float(value)
        elif name == "process_cpu_seconds_total":
            out["etcd_cpu_s"] += float(value)
    return out


# ----------------------------------------------------------------------------- client-side counts
class CallCounts:
    """Counts and times every ``MetadataStore`` call of this process by (thread role, kind):
    role ``dispatch`` for a rank's own thread, ``liveness`` for heartbeat and peer-watch threads."""

    def __init__(self):
        self.lock = threading.Lock()
        self.counts: Counter = Counter()
        self.seconds: Counter = Counter()
        self.cpu = time.process_time()

    def install(self) -> None:
        calls = self

        def wrap(name: str, fn):
            def counted(store, *a, **kw):
                role = "dispatch" if threading.current_thread().name.startswith("rank-") else "liveness"
                t0 = time.perf_counter()
                try:
                    return fn(store, *a, **kw)
                finally:
                    with calls.lock:
                        calls.counts[(role, CLIENT_KIND[name])] += 1
                        calls.seconds[threading.current_thread().name] += time.perf_counter() - t0

            return counted

        for name in CLIENT_KIND:
            setattr(MetadataStore, name, wrap(name, getattr(MetadataStore, name)))
        refresh = Lease.refresh

        def keepalive(lease):
            with calls.lock:
                calls.counts[("liveness", "keepalives")] += 1
            return refresh(lease)

        Lease.refresh = keepalive

    def take(self) -> tuple[dict, dict]:
        """The counts and per-thread seconds since the last take; ``seconds["cpu"]``: the
        CPU seconds of the whole process (every rank of the node and their dock threads)."""
        with self.lock:
            counts = {f"{r}/{k}": v for (r, k), v in self.counts.items()}
            seconds = dict(self.seconds)
            self.counts.clear()
            self.seconds.clear()
            cpu, self.cpu = self.cpu, time.process_time()
        return counts, seconds | {"cpu": self.cpu - cpu}


# ----------------------------------------------------------------------------- the flow
def flow(args) -> dict:
    """The stage graph, the column specs, and the sizes of one run of the harness."""
    cfg = load_config(PAPER_CONFIG, [f"rollout.n={args.N}"])
    graph = stages_for(cfg)
    return {"graph": graph, "specs": specs_of(column_decls(graph)), "cfg": cfg}


def synthetic(name: str, spec, n: int, PL: int, SL: int) -> object:
    """``n`` samples of column ``name``: a prompt of PL values, a response-length column of SL,
    a scalar per sample."""
    kind = COLUMNS[name]
    if kind == "scalar":
        return torch.zeros(n, dtype=spec.dtype)
    length = {"prompt": PL, "response": SL}.get(kind, 8)
    one = torch.zeros(length, dtype=spec.dtype)
    return [one] * n


class RankRun:
    """One rank of the harness: its dock and its iterations."""

    def __init__(self, spec: dict, f: dict, rank: int, barrier, calls: CallCounts):
        self.spec, self.f, self.rank, self.barrier, self.calls = spec, f, rank, barrier, calls
        k = spec["nproc_per_node"]
        self.peer = Peer(rank, spec["world"], rank // k, rank % k, k)
        self.gen = Layout(spec["world"] // spec["gen_tp"], spec["gen_tp"])
        self.train = Layout(spec["world"], 1)
        self.spans: list[tuple[int, str, float, float]] = []  # (iteration, stage, get start, put end)
        self.gets: list[tuple[int, float]] = []  # (iteration, seconds of one get)

    def start(self) -> TransferDock:
        cfg = DockConfig(
            mode="distributed",
            interface="127.0.0.1",
            port=0,
            get_timeout_s=600,
            records_group_nodes=self.spec["records_group_nodes"],
        )
        meta = MetadataStore([self.spec["etcd"]], self.spec["job"], retry_s=120.0, timeout_s=60.0)
        return TransferDock(cfg, meta, self.f["specs"], self.peer, TOKEN).start(self.spec["heartbeat_ttl_s"])

    def put_prompts(self, dock: TransferDock, it: int) -> None:
        """The gen-DP group's TP rank 0 puts its slice of the prompts, each repeated N times."""
        g, tp_rank = self.gen.coords(self.rank)
        per = self.spec["G"] // self.gen.dp
        if tp_rank == 0:
            N = self.spec["N"]
            idx = [q * N + k for q in range(g * per, (g + 1) * per) for k in range(N)]
            cols = ("prompt_ids", "answer", "prompt_row")
            dock.put("data", it, {c: self.column(c, len(idx)) for c in cols}, idx)

    def column(self, name: str, n: int) -> object:
        return synthetic(name, self.f["specs"][name], n, self.spec["PL"], self.spec["SL"])

    def iteration(self, dock: TransferDock, it: int) -> None:
        total = self.spec["G"] * self.spec["N"]
        dock.begin_iteration(it, total)
        self.put_prompts(dock, it)
        for stage in self.f["graph"]:
            layout = self.gen if stage.layout == "gen" else self.train
            t0 = time.time()
            batch = dock.get(stage.name, it, list(stage.inputs), layout, self.spec["N"] if stage.group_granular else 1)
            self.gets.append((it, time.time() - t0))
            if stage.outputs and layout.coords(self.rank)[1] == 0 and len(batch.indices):
                n = len(batch.indices)
                dock.put(stage.name, it, {c: self.column(c, n) for c in stage.outputs}, batch.indices)
            self.spans.append((it, stage.name, t0, time.time()))

    def run(self, out: dict) -> None:
        """The barriers the driver reads etcd at (``drive``); the node's local rank 0 takes the
        client counts at the same points, while no rank dispatches. After reporting, the rank
        keeps its dock (and its peer watch) until the driver is done with a node loss."""
        dock = self.start()
        self.barrier.wait()  # every rank and warehouse registered
        dock.watch_peers(lambda reason: self.sync.lost.put((self.rank, time.time(), reason)))
        phases = []
        for it in range(self.spec["iterations"]):
            self.barrier.wait()  # the driver has read etcd's counters
            self.iteration(dock, it)
            self.barrier.wait()  # the trainer's barrier before commit
            dock.commit(it)
            self.barrier.wait()  # iteration done
            phases.append(self.calls.take() if self.peer.local_rank == 0 else None)
        self.barrier.wait()  # the idle window starts: liveness only
        if self.peer.local_rank == 0:
            self.calls.take()
        self.barrier.wait()
        phases.append(self.calls.take() if self.peer.local_rank == 0 else None)
        stats = dock.warehouse_stats()
        out[self.rank] = {"spans": self.spans, "gets": self.gets, "warehouse": stats, "phases": phases}
        while not self.sync.done.value:
            time.sleep(0.1)
        dock.close()


class Sync:
    """What the driver and the node processes share (created before the fork)."""

    def __init__(self, ctx, parties: int):
        self.barrier = ctx.Barrier(parties)
        self.results = ctx.Queue()
        self.lost = ctx.Queue()
        """(rank, time, reason) from each rank whose peer watch reported a loss."""
        self.done = ctx.RawValue("b", 0)
        """Set once the driver is done with the ranks: a flag they poll, not an Event, whose
        ``set`` would wait forever for the waiters a node loss killed."""


def _or_abort(rank: RankRun, out: dict, sync: Sync) -> None:
    """A rank that fails breaks the barrier, so the driver stops with the rank's error
    instead of waiting for it."""
    try:
        rank.run(out)
    except BaseException as exc:
        print(f"rank {rank.rank} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        sync.barrier.abort()
        raise


def node_main(spec: dict, f: dict, node: int, sync: Sync) -> None:
    """One simulated node: its ranks as threads, their results to ``sync.results``."""
    calls = CallCounts()
    calls.install()
    out: dict = {}
    k = spec["nproc_per_node"]
    threads = []
    for r in range(node * k, (node + 1) * k):
        rank = RankRun(spec, f, r, sync.barrier, calls)
        rank.sync = sync
        threads.append(threading.Thread(target=_or_abort, args=(rank, out, sync), name=f"rank-{r}"))
    for t in threads:
        t.start()
    while len(out) < k and any(t.is_alive() for t in threads):
        time.sleep(0.05)
    sync.results.put((node, out))
    for t in threads:
        t.join()


# ----------------------------------------------------------------------------- the driver
def drive(args, nodes: int) -> dict:
    """One run at ``nodes`` nodes: the raw counts, spans and warehouse stats (``summarize``)."""
    k = args.nproc_per_node
    world = nodes * k
    G = nodes * args.prompts_per_node
    if G % (world // args.gen_tp):
        raise SystemExit(
            f"--prompts-per-node {args.prompts_per_node} x {nodes} nodes must divide over the generation DP groups"
        )
    spec = dict(
        world=world,
        nproc_per_node=k,
        gen_tp=args.gen_tp,
        G=G,
        N=args.N,
        PL=args.PL,
        SL=args.SL,
        iterations=args.iterations,
        heartbeat_ttl_s=args.heartbeat_ttl_s,
        records_group_nodes=args.records_group_nodes,
        job=f"cp{nodes}",
    )
    f = flow(args)
    with EmbeddedEtcd() as etcd:
        spec["etcd"] = etcd.endpoint
        ctx = mp.get_context("fork")
        sync = Sync(ctx, world + 1)
        procs = [ctx.Process(target=node_main, args=(spec, f, n, sync), daemon=True) for n in range(nodes)]
        for p in procs:
            p.start()
        server, idle = measure_iterations(args, sync, etcd.endpoint)
        results = [sync.results.get(timeout=args.timeout_s) for _ in procs]
        loss = node_loss(args, sync, etcd.endpoint, procs) if args.kill_node else None
        sync.done.value = 1
        for p in procs:
            p.join(timeout=60)
    ranks = {r: v for _, out in results for r, v in out.items()}
    return {"nodes": nodes, "spec": spec, "server": server, "idle": idle, "ranks": ranks, "flow": f, "loss": loss}


def measure_iterations(args, sync: Sync, endpoint: str) -> tuple[list[Counter], list]:
    """etcd's counters at each iteration boundary, and around the idle window."""

    def wait() -> None:
        try:
            sync.barrier.wait(args.timeout_s)
        except threading.BrokenBarrierError:
            raise SystemExit("a rank failed (its error is above) or the run passed --timeout-s") from None

    wait()  # registered
    server = [etcd_counters(endpoint)]
    for _ in range(args.iterations):
        for _ in range(3):  # go, before commit, done
            wait()
        server.append(etcd_counters(endpoint))
    wait()
    idle = [etcd_counters(endpoint), time.time()]
    time.sleep(args.idle_s)
    wait()
    return server, idle + [etcd_counters(endpoint), time.time()]


def node_loss(args, sync: Sync, endpoint: str, procs: list) -> dict:
    """SIGKILL the last node's process; the seconds until every surviving rank's peer watch
    reported it (first and last), and etcd's counts over that window."""
    k = args.nproc_per_node
    survivors = (len(procs) - 1) * k
    before = etcd_counters(endpoint)
    t_kill = time.time()
    procs[-1].kill()
    notices = []
    deadline = time.monotonic() + args.heartbeat_ttl_s + 60
    while len(notices) < survivors and time.monotonic() < deadline:
        try:
            notices.append(sync.lost.get(timeout=1.0))
        except queue_mod.Empty:
            pass
    if len(notices) < survivors:
        raise SystemExit(f"only {len(notices)} of {survivors} surviving ranks noticed the lost node")
    window = time.time() - t_kill
    spent = _delta(before, etcd_counters(endpoint))
    seen = sorted(t - t_kill for _, t, _ in notices)
    return {"first_s": seen[0], "last_s": seen[-1], "window_s": window} | {f"etcd_{k}": v for k, v in spent.items()}


def _delta(a: Counter, b: Counter) -> Counter:
    return Counter({k: b[k] - a[k] for k in set(a) | set(b)})


def _mean(rows: list[dict], key: str) -> float:
    return statistics.fmean(r.get(key, 0.0) for r in rows) if rows else 0.0


def client_phases(run: dict) -> list[Counter]:
    """Per phase (each iteration, then the idle window), the client counts of all nodes."""
    phases = [r["phases"] for r in run["ranks"].values() if r["phases"][0] is not None]
    return [sum((Counter(p[i][0]) for p in phases), Counter()) for i in range(len(phases[0]))]


def client_cpu(run: dict, i: int) -> float:
    """CPU seconds of every node process in phase ``i``."""
    return sum(r["phases"][i][1]["cpu"] for r in run["ranks"].values() if r["phases"][0] is not None)


def client_seconds(run: dict, i: int) -> float:
    """Seconds the ranks' own threads spent inside etcd calls in phase ``i``."""
    return sum(
        s
        for r in run["ranks"].values()
        if r["phases"][0] is not None
        for t, s in r["phases"][i][1].items()
        if t.startswith("rank-")
    )


def spans_of(run: dict, it: int) -> dict[str, tuple[float, float]]:
    """Per stage of iteration ``it``: (first rank's get start, last rank's put end)."""
    out: dict[str, tuple[float, float]] = {}
    for r in run["ranks"].values():
        for i, stage, t0, t1 in r["spans"]:
            if i == it:
                a, b = out.get(stage, (t0, t1))
                out[stage] = (min(a, t0), max(b, t1))
    return out


def summarize(run: dict) -> dict:
    """The per-S row: per iteration (mean of the steady ones) and per idle second."""
    spec, S = run["spec"], run["nodes"]
    R, steady = spec["world"], range(1, spec["iterations"])
    server = [_delta(run["server"][i], run["server"][i + 1]) for i in steady]
    client = client_phases(run)
    idle_s = run["idle"][3] - run["idle"][1]
    idle_server = _delta(run["idle"][0], run["idle"][2])
    spans = [spans_of(run, i) for i in steady]
    iteration_s = [max(b for _, b in sp.values()) - min(a for a, _ in sp.values()) for sp in spans]
    busy = [sum(t1 - t0 for r in run["ranks"].values() for i, _, t0, t1 in r["spans"] if i == it) for it in steady]
    gets = sorted(d for r in run["ranks"].values() for i, d in r["gets"] if i >= 1)
    wh = [r["warehouse"] for r in run["ranks"].values() if r["warehouse"] is not None]
    n, M, C = flow_counts(run["flow"]["graph"])
    eq4 = tcv_per_warehouse(spec["G"], spec["N"], 4, spec["PL"], spec["SL"], n, M, C, S) * GB
    row = {"nodes": S, "ranks": R, "iteration_s": statistics.median(iteration_s)}
    cold = _delta(run["server"][0], run["server"][1])  # the first iteration: connections, feeds, watches
    row |= {f"cold_etcd_{k}": cold[k] for k in ("reads", "writes", "watches", "watch_events", "etcd_cpu_s")}
    for k in ("reads", "writes", "watches", "watch_events", "keepalives", "sent_bytes", "etcd_cpu_s"):
        row[f"etcd_{k}_per_it"] = _mean(server, k)
        row[f"etcd_{k}_per_s_idle"] = idle_server[k] / idle_s
    for k in ("dispatch/reads", "dispatch/writes", "dispatch/watches", "liveness/reads", "liveness/writes"):
        row[f"client_{k}_per_it"] = _mean([client[i] for i in steady], k)
    for k in ("liveness/reads", "liveness/keepalives"):
        row[f"client_{k}_per_s_idle"] = client[-1][k] / idle_s
    row |= {
        "stage_dispatch_s": {st: statistics.median(sp[st][1] - sp[st][0] for sp in spans) for st in spans[0]},
        "get_p50_s": gets[len(gets) // 2],
        "get_p99_s": gets[min(len(gets) - 1, int(0.99 * len(gets)))],
        "client_cpu_s_per_it": statistics.fmean(client_cpu(run, i) for i in steady),
        "metadata_share": sum(client_seconds(run, i) for i in steady) / sum(busy),
        "warehouse_bytes_per_it": statistics.fmean((w["bytes_in"] + w["bytes_out"]) / spec["iterations"] for w in wh),
        "warehouse_bytes_max_over_mean": max(w["bytes_in"] + w["bytes_out"] for w in wh)
        / statistics.fmean(w["bytes_in"] + w["bytes_out"] for w in wh),
        "eq4_bytes": eq4,
        "loss": run["loss"],
    }
    return row


COLUMNS_PRINTED = (  # (header, value of a row), per rank where it says so
    ("S", lambda r: r["nodes"]),
    ("ranks", lambda r: r["ranks"]),
    ("reads/it/rank", lambda r: f"{r['etcd_reads_per_it'] / r['ranks']:.1f}"),
    ("writes/it/rank", lambda r: f"{r['etcd_writes_per_it'] / r['ranks']:.2f}"),
    ("watches/it/rank", lambda r: f"{r['etcd_watches_per_it'] / r['ranks']:.1f}"),
    ("watch events/it/rank", lambda r: f"{r['etcd_watch_events_per_it'] / r['ranks']:.0f}"),
    ("idle keep-alives/s/rank", lambda r: f"{r['etcd_keepalives_per_s_idle'] / r['ranks']:.2f}"),
    ("idle reads/s/rank", lambda r: f"{r['etcd_reads_per_s_idle'] / r['ranks']:.2f}"),
    ("etcd KB sent/it/rank", lambda r: f"{r['etcd_sent_bytes_per_it'] / r['ranks'] / 1024:.0f}"),
    ("etcd CPU-s/it", lambda r: f"{r['etcd_etcd_cpu_s_per_it']:.2f}"),
    ("ranks' CPU-s/it/rank", lambda r: f"{r['client_cpu_s_per_it'] / r['ranks']:.3f}"),
    ("dispatch s", lambda r: f"{r['iteration_s']:.2f}"),
    ("get p50/p99 s", lambda r: f"{r['get_p50_s']:.3f}/{r['get_p99_s']:.3f}"),
    ("in etcd calls %", lambda r: f"{100 * r['metadata_share']:.1f}"),
    (
        "warehouse MB/it (max/mean)",
        lambda r: f"{r['warehouse_bytes_per_it'] / 2**20:.2f} ({r['warehouse_bytes_max_over_mean']:.2f})",
    ),
    ("Eq. 4 MB", lambda r: f"{r['eq4_bytes'] / 2**20:.2f}"),
)


def print_rows(rows: list[dict], args) -> None:
    print(
        f"\n{platform.processor() or platform.machine()}, {os.cpu_count()} cores; K={args.nproc_per_node} ranks/node, "
        f"gen TP {args.gen_tp}, {args.prompts_per_node} prompts x N={args.N} per node, PL {args.PL}, SL {args.SL}, "
        f"records watched once per {args.records_group_nodes} nodes"
    )
    print("| " + " | ".join(h for h, _ in COLUMNS_PRINTED) + " |\n|" + "---|" * len(COLUMNS_PRINTED))
    for r in rows:
        print("| " + " | ".join(str(f(r)) for _, f in COLUMNS_PRINTED) + " |")
    for r in rows:
        if r["loss"]:
            L = r["loss"]
            print(
                f"S={r['nodes']}: one node SIGKILLed; every survivor's peer watch reported it after "
                f"{L['first_s']:.1f}-{L['last_s']:.1f} s (lease {args.heartbeat_ttl_s} s); etcd in that window: "
                f"{L['etcd_reads']:.0f} reads, {L['etcd_writes']:.0f} writes, {L['etcd_watch_events']:.0f} watch "
                f"events, {L['etcd_keepalives']:.0f} keep-alives, {L['etcd_etcd_cpu_s']:.2f} CPU-s"
            )


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", default="4,8,16", help="comma-separated S values")
    p.add_argument("--nproc-per-node", type=int, default=4)
    p.add_argument("--gen-tp", type=int, default=4, help="generation TP (training is DP over every rank)")
    p.add_argument("--prompts-per-node", type=int, default=4, help="G per node (weak scaling: the same data per node)")
    p.add_argument("--N", type=int, default=16, help="responses per prompt (the paper: 16)")
    p.add_argument("--PL", type=int, default=256, help="prompt length (the paper: 2048)")
    p.add_argument("--SL", type=int, default=1024, help="response length (the paper: 8192)")
    p.add_argument("--iterations", type=int, default=3, help="the first is cold and not counted")
    p.add_argument("--heartbeat-ttl-s", type=int, default=10, help="elastic.heartbeat_ttl_s")
    p.add_argument(
        "--records-group-nodes",
        type=int,
        default=DockConfig().records_group_nodes,
        help="dock.records_group_nodes: nodes whose warehouses follow etcd's records through one watch",
    )
    p.add_argument("--idle-s", type=float, default=5.0, help="window that measures the liveness traffic alone")
    p.add_argument("--timeout-s", type=float, default=900.0)
    p.add_argument("--kill-node", action="store_true", help="then SIGKILL one node and time its detection")
    p.add_argument("--json", help="write the rows, the capacity and the model here")
    p.add_argument("--fit", action="store_true", help="fit the cost model and extrapolate (needs 2+ node counts)")
    p.add_argument("--capacity", action="store_true", help="measure etcd's capacity on this machine")
    p.add_argument("--capacity-clients", type=int, default=8)
    p.add_argument("--capacity-s", type=float, default=5.0)
    p.add_argument("--iteration-s", type=float, default=60.0, help="a short iteration, besides the paper's")
    args = p.parse_args(argv)
    args.node_counts = [int(x) for x in args.nodes.split(",")]
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse(argv)
    rows = []
    for nodes in args.node_counts:
        t0 = time.time()
        rows.append(summarize(drive(args, nodes)))
        print(f"S={nodes}: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    print_rows(rows, args)
    cap = capacity(args) if args.capacity else None
    model = fit(rows) if args.fit else None
    if model:
        for t in sorted({args.iteration_s, PAPER_ITERATION_S}):
            print_model(model, cap, t, args.nproc_per_node)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "capacity": cap, "model": model}, indent=1))
    return rows


# ----------------------------------------------------------------------------- etcd's capacity
CAPACITY_OPS = ("put", "range", "keepalive", "watch_event")


def _hammer(endpoint: str, op: str, worker: int, seconds: float, counts) -> None:
    """One client process: ``op`` in a loop for ``seconds``; its count into ``counts[worker]``."""
    meta = MetadataStore([endpoint], "capacity")
    lease = meta.lease(60) if op == "keepalive" else None
    value = b"x" * 300  # a put-record's size
    n, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        if op == "put":
            meta.put(meta.key("p", worker, n), value)
        elif op == "range":
            meta.get_prefix(meta.key("r") + "/")
        else:
            lease.refresh()
        n += 1
    counts[worker] = n


def _watch_events(endpoint: str, watchers: int, puts: int) -> tuple[float, float]:
    """``watchers`` watches of one prefix, ``puts`` puts into it: (events delivered, seconds)."""
    meta = MetadataStore([endpoint], "capacity")
    streams = [meta.watch_prefix(meta.key("w") + "/", puts_only=True) for _ in range(watchers)]
    got = [0] * watchers

    def drain(k: int, events) -> None:
        for _ in events:
            got[k] += 1
            if got[k] == puts:
                return

    threads = [threading.Thread(target=drain, args=(k, ev), daemon=True) for k, (ev, _) in enumerate(streams)]
    for t in threads:
        t.start()
    t0 = time.monotonic()
    for n in range(puts):
        meta.put(meta.key("w", n), b"x" * 300)
    for t in threads:
        t.join(timeout=120)
    for _, cancel in streams:
        cancel()
    return float(sum(got)), time.monotonic() - t0


def capacity(args) -> dict[str, dict[str, float]]:
    """Per operation: what ``--capacity-clients`` client processes achieved per second against
    one etcd with fsync on this machine, and etcd's own CPU seconds per operation (its
    ``process_cpu_seconds_total``): 1 / that is what one etcd core serves."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp, EmbeddedEtcd(data_dir=tmp) as etcd:
        seed = MetadataStore([etcd.endpoint], "capacity")
        for k in range(64):  # a range read returns 64 records, a stage's worth at 64 ranks
            seed.put(seed.key("r", f"{k:04d}"), b"x" * 300)
        ctx = mp.get_context("fork")
        for op in CAPACITY_OPS:
            before = etcd_counters(etcd.endpoint)
            t0 = time.monotonic()
            if op == "watch_event":
                n, _ = _watch_events(etcd.endpoint, args.capacity_clients * 4, 500)
            else:
                counts = ctx.Array("d", args.capacity_clients)
                procs = [
                    ctx.Process(target=_hammer, args=(etcd.endpoint, op, w, args.capacity_s, counts))
                    for w in range(args.capacity_clients)
                ]
                for p in procs:
                    p.start()
                for p in procs:
                    p.join()
                n = sum(counts)
            spent = _delta(before, etcd_counters(etcd.endpoint))
            out[op] = {"ops_per_s": n / (time.monotonic() - t0), "etcd_cpu_s_per_op": spent["etcd_cpu_s"] / n}
    return out


# ----------------------------------------------------------------------------- the cost model
PAPER_ITERATION_S = 437.0
"""The paper's DeepSeek-R1-671B run: G 384 x N 32 x (PL 1K + SL 2K) tokens at 200-250 TPS on
384 NPUs (Eq. 5): ETE = 384 x 32 x 3072 / 384 / 225 = 437 s."""
FITTED = {  # per-iteration quantity of a row -> the powers of R it is fitted with
    "etcd_writes_per_it": (1, 0),
    "etcd_reads_per_it": (1, 0),
    "etcd_watch_events_per_it": (2, 1),
    "etcd_sent_bytes_per_it": (2, 1),
    "etcd_etcd_cpu_s_per_it": (2, 1),
}


def fit(rows: list[dict]) -> dict[str, list[float]]:
    """Least-squares coefficients of each ``FITTED`` quantity in its powers of the rank count,
    plus keep-alives per node and second (idle), averaged: one lease per node
    (``dock.node_lease``), so they follow the node count, not the rank count."""
    import numpy as np

    R = np.array([r["ranks"] for r in rows], dtype=float)
    out = {}
    for key, powers in FITTED.items():
        A = np.stack([R**p for p in powers], axis=1)
        coef, *_ = np.linalg.lstsq(A, np.array([r[key] for r in rows]), rcond=None)
        out[key] = [float(c) for c in coef]
    out["keepalives_per_node_s"] = [statistics.fmean(r["etcd_keepalives_per_s_idle"] / r["nodes"] for r in rows)]
    return out


def predict(model: dict, key: str, ranks: float) -> float:
    return sum(c * ranks**p for c, p in zip(model[key], FITTED[key]))


def extrapolate(model: dict, cap: dict | None, iteration_s: float, ranks: list[int], ranks_per_node: int) -> list[dict]:
    """Per rank count: etcd's load at one iteration per ``iteration_s`` with ``ranks_per_node``
    ranks on each node, and against the capacity measured on this machine (one etcd core:
    1 / CPU seconds per operation)."""
    rows = []
    for R in ranks:
        writes_s = predict(model, "etcd_writes_per_it", R) / iteration_s
        events_s = predict(model, "etcd_watch_events_per_it", R) / iteration_s
        keep_s = model["keepalives_per_node_s"][0] * R / ranks_per_node
        cpu = predict(model, "etcd_etcd_cpu_s_per_it", R) / iteration_s
        row = {"ranks": R, "writes_s": writes_s, "reads_s": predict(model, "etcd_reads_per_it", R) / iteration_s}
        row |= {"watch_events_s": events_s, "keepalives_s": keep_s, "etcd_cpu_share": cpu}
        row["sent_MB_s"] = predict(model, "etcd_sent_bytes_per_it", R) / iteration_s / 2**20
        if cap:
            row["write_capacity_share"] = writes_s / min(cap["put"]["ops_per_s"], 1 / cap["put"]["etcd_cpu_s_per_op"])
            row["etcd_cpu_share"] += keep_s * cap["keepalive"]["etcd_cpu_s_per_op"]
        rows.append(row)
    return rows


def print_model(model: dict, cap: dict | None, iteration_s: float, ranks_per_node: int) -> None:
    print(
        "\nfitted per iteration (R = ranks): "
        + "; ".join(
            f"{k.removeprefix('etcd_').removesuffix('_per_it')} = "
            + " + ".join(f"{c:.3g} R^{p}" for c, p in zip(model[k], FITTED[k]))
            for k in FITTED
        )
        + f"; keep-alives {model['keepalives_per_node_s'][0]:.3f} per node and second"
    )
    if cap:
        print(
            "\netcd capacity on this machine (fsync on): "
            + "; ".join(
                f"{op} {v['ops_per_s']:.0f}/s achieved, {1e6 * v['etcd_cpu_s_per_op']:.1f} etcd CPU-us each"
                for op, v in cap.items()
            )
        )
    print(f"\nat one iteration per {iteration_s:.0f} s, {ranks_per_node} ranks per node:")
    print(
        "| ranks | writes/s | reads/s | watch events/s | keep-alives/s | etcd MB/s sent | etcd CPU (cores) "
        "| of write capacity |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in extrapolate(model, cap, iteration_s, [256, 1024, 4096, 16384], ranks_per_node):
        share = f"{100 * r['write_capacity_share']:.2f} %" if "write_capacity_share" in r else "-"
        print(
            f"| {r['ranks']} | {r['writes_s']:.1f} | {r['reads_s']:.1f} | {r['watch_events_s']:.0f} | "
            f"{r['keepalives_s']:.0f} | {r['sent_MB_s']:.2f} | {r['etcd_cpu_share']:.3f} | {share} |"
        )


if __name__ == "__main__":
    main()
