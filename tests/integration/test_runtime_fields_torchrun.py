"""Runtime fields act, observed from outside the ranks (fields wired without a test
that would notice). Each runs the real CLI with two values and looks at what the run did:

- ``dock.port`` (non-zero) is the port node 0's warehouse registers in etcd, ``elastic.
  heartbeat_ttl_s`` the TTL granted to each rank's liveness lease, ``logging.progress`` the
  per-iteration lines on stderr, and the same run's terminal shows no vLLM chatter;
- ``metadata.retry_s`` is how long a rank retries an unreachable etcd before it gives up;
- ``stream.max_policy_lag`` = 2 lets a separated run train iteration i on samples of policy
  i - 2 (k = 1 allows only i - 1)."""

from __future__ import annotations

import base64
import socket
import subprocess
import sys
import threading

import pytest
import requests

from tests.conftest import REPO, subprocess_env
from tests.trainer_util import train


def _lease_ttls_and_warehouse(endpoint: str, job: str, seen: dict, stop: threading.Event) -> None:
    """Poll etcd (the v3 HTTP gateway, no client of the project) while the run lives."""

    def rng(key: str, prefix: bool = False) -> list[dict]:
        body = {"key": base64.b64encode(key.encode()).decode()}
        if prefix:
            body["range_end"] = base64.b64encode(key[:-1].encode() + bytes([ord(key[-1]) + 1])).decode()
        return requests.post(f"http://{endpoint}/v3/kv/range", json=body, timeout=5).json().get("kvs", [])

    while not stop.wait(0.2):
        try:
            for kv in rng(f"/{job}/alive/", prefix=True):
                got = requests.post(
                    f"http://{endpoint}/v3/lease/timetolive", json={"ID": kv["lease"]}, timeout=5
                ).json()
                seen.setdefault("ttl", set()).add(int(got["grantedTTL"]))
            for kv in rng(f"/{job}/warehouses/0"):
                seen["warehouse"] = base64.b64decode(kv["value"]).decode()
        except (requests.RequestException, KeyError, ValueError):
            continue


def _run_observed(tmp_path, etcd, name: str, *overrides: str) -> tuple[dict, str]:
    seen: dict = {}
    stop = threading.Event()
    poll = threading.Thread(
        target=_lease_ttls_and_warehouse, args=(etcd.endpoint, f"t-{name}", seen, stop), daemon=True
    )
    poll.start()
    try:
        train(tmp_path, name, etcd.endpoint, "checkpoint.interval=0", *overrides)
    finally:
        stop.set()
        poll.join()
    return seen, (tmp_path / name / "stderr.log").read_text()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def fields_a(tiny_model, tmp_path_factory, etcd) -> tuple[dict, str, int, object]:
    """A 2-iteration quickstart run with a fixed dock port, a 5 s heartbeat TTL and the progress
    lines on: what the etcd poller saw, its stderr, the port, its folder. Shared by the field
    test and the terminal test below."""
    tmp = tmp_path_factory.mktemp("fields")
    port = _free_port()  # a race with another process only fails this test's bind, loudly
    seen, err = _run_observed(
        tmp, etcd, "fields-a", f"dock.port={port}", "elastic.heartbeat_ttl_s=5", "logging.progress=true"
    )
    return seen, err, port, tmp / "fields-a"


@pytest.mark.slow
def test_dock_port_heartbeat_ttl_and_progress_act(fields_a, tmp_path, etcd):
    a, err_a, port, _ = fields_a
    b, err_b = _run_observed(
        tmp_path, etcd, "fields-b", "dock.port=0", "elastic.heartbeat_ttl_s=9", "logging.progress=false"
    )
    assert a.get("ttl") == {5} and b.get("ttl") == {9}, (a, b)
    assert a["warehouse"].endswith(f':{port}"}}') and not b["warehouse"].endswith(f':{port}"}}'), (a, b)
    assert err_a.count("iter 1/2") == 1 and err_a.count("iter 2/2") == 1
    assert "iter 1/2" not in err_b


@pytest.mark.slow
def test_a_run_terminal_shows_no_vllm_chatter(fields_a):
    """The terminal filter (``engines.vllm.logs``, unit-tested in test_vllm_logs.py) on a real
    run: no vLLM chatter on stderr, one unwrapped progress line per iteration, and vLLM's own log
    kept per rank in the run folder."""
    _, err, _, run = fields_a
    assert "Failed to load weights" not in err and "LD_PRELOAD" not in err and "reduce_op" not in err, err[-3000:]
    assert "vllm" not in err.lower().replace("vllm-rank", ""), err[-3000:]
    assert err.count("iter 1/2 ") == 1 and err.count("iter 2/2 ") == 1
    assert [line for line in err.splitlines() if line.startswith("iter 1/2")][0].endswith("tok/s/dev")  # not wrapped
    logs = sorted(p.name for p in (run / "logs").glob("vllm-rank*.log"))
    assert logs == ["vllm-rank0.log", "vllm-rank1.log"]
    assert "Failed to load weights" in (run / "logs/vllm-rank0.log").read_text()  # kept in the run folder


@pytest.mark.slow
@pytest.mark.parametrize("retry_s", [1, 3])
def test_metadata_retry_s_is_how_long_a_rank_waits_for_etcd(tiny_model, tmp_path, retry_s):
    closed = _free_port()  # nothing listens there
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "spmd_rl.cli",
            "train",
            "configs/quickstart.yaml",
            f"metadata.endpoints=[127.0.0.1:{closed}]",
            f"metadata.retry_s={retry_s}",
            "elastic.max_restarts=0",
            f"checkpoint.dir={tmp_path}/ckpt",
            f"logging.dir={tmp_path}/logs",
            "trainer.iterations=1",
        ],
        cwd=REPO,
        env=subprocess_env() | {"OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode != 0
    assert f"unreachable for {retry_s}s" in res.stderr, res.stderr[-3000:]


@pytest.mark.slow
def test_max_policy_lag_two_trains_on_samples_two_updates_old(tiny_model, tmp_path, etcd):
    rows = train(
        tmp_path,
        "lag2",
        etcd.endpoint,
        "parallel.placement=separated",
        "parallel.gen_ranks=1",
        "parallel.gen.dp=1",
        "parallel.train.dp_shard=1",
        "actor.correction.tis_cap=2.0",
        "trainer.iterations=4",
        "checkpoint.interval=0",
        "stream.max_policy_lag=2",
    )
    assert [r["gen_version"] for r in rows] == [max(0, r["iteration"] - 2) for r in rows]  # k = 1 gives it - 1
    assert max(r["policy_lag_max"] for r in rows) == 2
