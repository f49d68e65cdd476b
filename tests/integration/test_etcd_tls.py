"""A standalone etcd with TLS and client-certificate auth, set up by the launch scripts
(launch/make_certs.sh, launch/etcd.sh with TLS_DIR): a rank with the job's certificates
trains through launch/multi_node.sh (torchrun's etcd-v2 rendezvous and the dock's metadata
both over TLS); a rank without a client certificate, or speaking plain HTTP, is refused with a
message naming the fields to set; no plain-text connection is served."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import requests

from spmd_rl.dock.errors import DockUnavailable
from spmd_rl.dock.etcd_server import free_port
from spmd_rl.dock.metadata import EtcdTLS, MetadataStore
from tests.conftest import REPO, subprocess_env

SMALL = [
    "data.global_batch_size=8",
    "rollout.n=4",
    "actor.mini_batch_size=8",
    "actor.micro_batch_size=8",
    "logging.progress=false",
    "dock.port=0",
]


@pytest.fixture(scope="module")
def tls_etcd(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tls")
    subprocess.run([str(REPO / "launch/make_certs.sh"), str(tmp / "certs"), "127.0.0.1"], check=True)
    while True:
        port = free_port()
        if port + 1 < 65536:
            break
    proc = subprocess.Popen(
        [str(REPO / "launch/etcd.sh"), "127.0.0.1", str(port), str(tmp / "data")],
        cwd=REPO,
        env=subprocess_env() | {"TLS_DIR": str(tmp / "certs")},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    certs = tmp / "certs"
    tls = EtcdTLS(str(certs / "ca.crt"), str(certs / "client.crt"), str(certs / "client.key"))
    store = MetadataStore([f"127.0.0.1:{port}"], "tls-probe", retry_s=1, tls=tls)
    deadline = time.monotonic() + 30
    while not store.healthy():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()[-2000:]
        time.sleep(0.2)
    yield f"127.0.0.1:{port}", tls, tmp
    proc.terminate()
    proc.wait(timeout=30)


@pytest.mark.slow
def test_plain_text_and_certless_clients_are_refused(tls_etcd):
    endpoint, tls, _ = tls_etcd
    with pytest.raises(requests.ConnectionError):  # plain HTTP: the server closes the connection
        requests.post(f"http://{endpoint}/v3/kv/range", json={"key": "Lw=="}, timeout=5)
    with pytest.raises(DockUnavailable, match="serves TLS only, set metadata.ca_file"):
        MetadataStore([endpoint], "tls-plain", retry_s=1).get("/x")
    t0 = time.monotonic()
    with pytest.raises(DockUnavailable, match="refused the TLS connection .*metadata.ca_file, cert_file and key_file"):
        MetadataStore([endpoint], "tls-nocert", retry_s=30, tls=EtcdTLS(tls.ca_file)).get("/x")
    print(f"refused after {time.monotonic() - t0:.1f} s (retry_s 30: the refusal is not retried)")
    good = MetadataStore([endpoint], "tls-good", tls=tls)
    good.put(good.key("k"), b"v")
    assert good.get(good.key("k")) == b"v"
    # the peer port (client port + 1) serves TLS too: plain HTTP there gets no member list
    host, port = endpoint.rsplit(":", 1)
    try:
        peer = requests.get(f"http://{host}:{int(port) + 1}/members", timeout=5)
    except requests.ConnectionError:
        peer = None
    assert peer is None or (peer.status_code == 400 and "HTTPS" in peer.text), (peer.status_code, peer.text[:200])


@pytest.mark.slow
def test_rank_with_certs_trains_and_rank_without_is_refused(tiny_model, tls_etcd):
    endpoint, tls, tmp = tls_etcd
    env = subprocess_env() | {
        "ETCD": endpoint,
        "JOB": "tls-job",
        "NNODES": "1:1",
        "NPROC": "1",
        "TOKEN": "tls-token-0123456789abcdef",
        "ETCD_CA": tls.ca_file,
        "ETCD_CERT": tls.cert_file,
        "ETCD_KEY": tls.key_file,
    }
    run = subprocess.run(
        [
            str(REPO / "launch/multi_node.sh"),
            "configs/quickstart.yaml",
            "parallel.train.dp_shard=null",
            "parallel.gen.dp=null",
            "parallel.nproc_per_node=1",
            "trainer.iterations=2",
            f"checkpoint.dir={tmp}/ckpt",
            f"logging.dir={tmp}/logs",
            *SMALL,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp / "logs/metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1]
    # the same job without the client certificate: the rank is refused and says what to set
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "spmd_rl.cli",
            "train",
            "configs/quickstart.yaml",
            "parallel.nproc_per_node=1",
            "parallel.train.dp_shard=1",
            "parallel.gen.dp=1",
            "trainer.iterations=1",
            f"metadata.endpoints=[{endpoint}]",
            f"metadata.ca_file={tls.ca_file}",
            "elastic.max_restarts=0",
            f"checkpoint.dir={tmp}/ckpt2",
            f"logging.dir={tmp}/logs2",
            *SMALL,
        ],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert refused.returncode != 0
    assert "UNAVAILABLE etcd" in refused.stderr and "refused the TLS connection" in refused.stderr, refused.stderr[
        -3000:
    ]
