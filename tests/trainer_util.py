"""Run ``spmd-rl train`` on the quickstart config with test overrides and read its metrics."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO, subprocess_env

G, N = 8, 4


def train(
    tmp: Path,
    name: str,
    etcd: str,
    *overrides: str,
    check: bool = True,
    extra_env: dict[str, str] | None = None,
    config: str = "configs/quickstart.yaml",
) -> list[dict]:
    """Two iterations by default (later overrides win); returns the metrics rows. The run's
    stderr is kept in ``<tmp>/<name>/stderr.log``."""
    env = subprocess_env() | {
        "SPMD_RL_ETCD": etcd,
        "OMP_NUM_THREADS": "1",
        "SPMD_RL_JOB_TOKEN": "trainer-test-token-0123456789",
    }
    env |= extra_env or {}
    args = [
        f"checkpoint.dir={tmp / name}/ckpt",
        f"logging.dir={tmp / name}/logs",
        "trainer.iterations=2",
        f"data.global_batch_size={G}",
        f"rollout.n={N}",
        f"actor.mini_batch_size={G}",
        "actor.micro_batch_size=8",
        "trainer.deterministic=true",
        "checkpoint.interval=1",
        "checkpoint.keep=5",
        f"metadata.job=t-{name}",
        "dock.port=0",
        "logging.progress=false",
        *overrides,
    ]
    res = subprocess.run(
        [sys.executable, "-m", "spmd_rl.cli", "train", config, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    (tmp / name).mkdir(parents=True, exist_ok=True)
    (tmp / name / "stderr.log").write_text(res.stderr)
    if check:
        assert res.returncode == 0, res.stderr[-4000:]
        assert "Traceback" not in res.stderr, res.stderr[
            -4000:
        ]  # a run that succeeds ends quietly, vLLM's shutdown too
    return [json.loads(line) for line in (tmp / name / "logs/metrics.jsonl").read_text().splitlines()]
