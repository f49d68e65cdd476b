"""A torchrun worker for the dock integration test: generation DP writes, training DP reads.

Env: SPMD_RL_ETCD (endpoint), SPMD_RL_OUT (folder for per-rank JSON results), DOCK_MODE,
G, N, GEN_TP, TRAIN_TP, RLEN (responses are 1 to RLEN - 1 tokens), optional WRITERS (only the
first WRITERS ranks generate, as a separated placement's generation nodes do) and RELAY_MIN
(``dock.tp_relay_min_bytes``). Sample content is a pure function of the index, so every reader
can check every byte it receives.
"""

from spmd_rl.engines.vllm.logs import QUIET_ENV  # noqa: E402
from spmd_rl.launcher.preload import delegate  # noqa: E402

delegate(sets=QUIET_ENV)  # forked past the imports when the suite's preload server runs (vLLM unused here)


import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from spmd_rl.config.layout import Layout
from spmd_rl.config.schema import DockConfig
from spmd_rl.recipe.graph import Stage
from spmd_rl.distributed.teardown import exit_after
from spmd_rl.dock.client import TransferDock
from spmd_rl.dock.fetch import Peer
from spmd_rl.dock.columns import specs_of
from spmd_rl.recipe.columns import column_decls
from spmd_rl.dock.metadata import MetadataStore

TOKEN = "integration-test-token-0123456789"


def sample(i: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i)
    plen = int(torch.randint(3, 12, (1,), generator=g))
    rlen = int(torch.randint(1, int(os.environ.get("RLEN", 40)), (1,), generator=g))
    return {
        "prompt_ids": torch.randint(0, 2**31 - 1, (plen,), generator=g, dtype=torch.int32),
        "response_ids": torch.randint(0, 2**31 - 1, (rlen,), generator=g, dtype=torch.int32),
        "rollout_log_prob": torch.randn(rlen, generator=g),
        "reward": torch.randn((), generator=g),
    }


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    npn = int(os.environ["LOCAL_WORLD_SIZE"])
    peer = Peer(rank, world, int(os.environ["GROUP_RANK"]), int(os.environ["LOCAL_RANK"]), npn)
    G, N = int(os.environ["G"]), int(os.environ["N"])
    writers = int(os.environ.get("WRITERS", world))
    gen = Layout(writers // int(os.environ["GEN_TP"]), int(os.environ["GEN_TP"]))
    train = Layout(world // int(os.environ["TRAIN_TP"]), int(os.environ["TRAIN_TP"]))
    stages = [
        Stage("actor_rollout", ("prompt_ids",), ("response_ids", "rollout_log_prob")),
        Stage("reward", (), ("reward",)),
    ]
    specs = specs_of(column_decls(stages))
    meta = MetadataStore([os.environ["SPMD_RL_ETCD"]], job=f"dock-test-{os.environ['DOCK_MODE']}-w{writers}")
    relay_min = int(os.environ.get("RELAY_MIN", DockConfig.model_fields["tp_relay_min_bytes"].default))
    cfg = DockConfig(mode=os.environ["DOCK_MODE"], port=0, get_timeout_s=60, tp_relay_min_bytes=relay_min)
    dock = TransferDock(cfg, meta, specs, peer, TOKEN).start()
    dist.barrier()
    dock.begin_iteration(0, G * N)

    gdp, gtp = gen.coords(rank) if rank < writers else (None, None)
    per_group = G * N // gen.dp
    if gtp == 0:  # one writer per generation DP group
        mine = list(range(gdp * per_group, (gdp + 1) * per_group))
        rows = [sample(i) for i in mine]
        cols = {c: [r[c] for r in rows] for c in ("prompt_ids", "response_ids", "rollout_log_prob")}
        dock.put("actor_rollout", 0, cols, mine)
        dock.put("reward", 0, {"reward": torch.stack([r["reward"] for r in rows])}, mine)

    got = dock.get("actor_update", 0, ["prompt_ids", "response_ids", "rollout_log_prob", "reward"], train)
    grouped = dock.get("advantage", 0, ["reward", "response_ids"], train, group_size=N)
    mismatches = 0
    for k, i in enumerate(got.indices.tolist()):
        ref = sample(i)
        for c in ref:
            a, b = got.columns[c][k], ref[c]
            if (
                a.dtype != b.dtype
                or a.shape != b.shape
                or a.view(-1).view(torch.uint8).tolist() != b.view(-1).view(torch.uint8).tolist()
            ):
                mismatches += 1
    td = got.padded()
    tokens = int(td["response_ids_length"].sum() + td["prompt_ids_length"].sum())
    dist.barrier()
    stats = dock.warehouse_stats()
    home = dock._clients.get(peer.node)
    relayed = sorted(dock.relay_calls.get(0, {}))  # the stages whose share came through the TP leader
    out = {
        "shm_bytes": getattr(home, "shm_bytes", None),
        "relayed": relayed,
        "rank": rank,
        "node": peer.node,
        "indices": got.indices.tolist(),
        "grouped": grouped.indices.tolist(),
        "mismatches": mismatches,
        "tokens": tokens,
        "stats": stats,
        "padded_shape": list(td["response_ids"].shape),
    }
    Path(os.environ["SPMD_RL_OUT"], f"rank{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dock.commit(0)
    dist.barrier()
    if stats is not None:
        out["after_commit_samples"] = dock.warehouse_stats()["samples"]
        Path(os.environ["SPMD_RL_OUT"], f"rank{rank}.json").write_text(json.dumps(out))
    left = meta.get_prefix(meta.key(0) + "/")
    Path(os.environ["SPMD_RL_OUT"], f"meta{rank}.json").write_text(json.dumps(len(left)))
    dock.close()


if __name__ == "__main__":
    exit_after(main)
