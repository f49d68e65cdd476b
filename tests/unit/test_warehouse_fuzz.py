"""No input from any peer stops a warehouse: several hundred hostile frames (random bytes,
mutated valid messages, hostile headers and metas sealed with the job's key, with a wrong key,
with a garbage MAC or none, oversized declared sizes and frames) against a live warehouse
server. After each one the server answers a valid ``stats`` request, the sample stored before
is returned unchanged, and memory stays bounded.

Messages sealed with the job's key can still be valid requests (a peer holding the token is
the job itself); the generator keeps those off the stored iteration 0, so any change to the
stored sample is a bug."""

from __future__ import annotations

import random
import subprocess
import sys

import msgpack
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spmd_rl.dock.auth import job_key, seal
from spmd_rl.dock.warehouse import WarehouseServer
from spmd_rl.dock.warehouse_client import WarehouseClient
from spmd_rl.dock.wire import DTYPES, encode

TOKEN = "fuzz-test-token-0123456789abcdef"
KEY, WRONG_KEY = job_key(TOKEN), job_key("wrong-token-0123456789abcdef")
MAX_MSG = 1 << 20
SAMPLE = torch.arange(7, dtype=torch.int32)


@pytest.fixture(scope="module")
def live():
    server = WarehouseServer("127.0.0.1", 0, TOKEN, bucket_bytes=1 << 16, max_message_bytes=MAX_MSG).start()
    client = WarehouseClient(server.address, TOKEN, timeout_s=10, max_message_bytes=MAX_MSG)
    client.put(0, [3], {"response_ids": [SAMPLE]}, {"response_ids": True})
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(server.address)
    yield server, client, raw
    raw.close()
    client.close()
    server.stop()


def _send(raw, frames) -> None:
    raw.send_multipart(frames)
    wait = 1000
    while raw.poll(wait):  # drain whatever the server answers (every request gets an answer
        raw.recv_multipart()  # unless libzmq dropped the peer for an oversized frame)
        wait = 20


def _still_serving(server, client) -> None:
    assert server._thread.is_alive()
    assert client.stats()["samples"] >= 1  # a mutation may still be a valid, authenticated put
    assert torch.equal(client.get(0, [3], ["response_ids"])["response_ids"][0], SAMPLE)


ints = st.integers(min_value=-(2**63), max_value=2**64 - 1)
anything = st.recursive(
    st.none() | st.booleans() | ints | st.floats() | st.text(max_size=6) | st.binary(max_size=6),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
    max_leaves=8,
)
dims = st.one_of(ints, st.booleans(), st.just(2**32), st.floats(), st.text(max_size=2))
meta = st.one_of(
    anything,
    st.fixed_dictionaries(
        {
            "dtype": st.one_of(
                st.sampled_from(list(DTYPES)),
                st.lists(st.text(max_size=3), max_size=2),
                ints,
                st.none(),
                st.text(max_size=8),
            ),
            "shape": st.one_of(st.lists(dims, max_size=4), st.just([2**32, 2**32]), st.just([True]), anything),
        }
    ),
)
header = st.fixed_dictionaries(
    {
        "op": st.one_of(st.sampled_from(["put", "get", "delete", "drop", "stats", "bogus"]), anything),
    },
    optional={
        "iter": st.one_of(st.just(1), anything.filter(lambda x: not (isinstance(x, (int, float)) and x == 0))),
        "indices": st.one_of(st.lists(st.integers(0, 5), max_size=4), anything),
        "columns": st.one_of(
            st.just({"response_ids": {"ragged": True, "lengths": [2]}}), st.just(["response_ids"]), anything
        ),
        "tensors": st.lists(meta, max_size=3),
        # a same-node reference (dock.shm): another process's memfd, forged or pointing anywhere
        "shm": st.one_of(
            anything,
            st.fixed_dictionaries(
                {
                    "pid": st.one_of(st.just(1), st.just(0), ints),
                    "fd": st.one_of(st.integers(0, 1024), ints, anything),
                    "ino": st.one_of(ints, anything),
                    "capacity": st.one_of(st.just(2**62), ints, anything),
                }
            ),
        ),
    },
)


def _valid_put() -> list[bytes]:
    frames = encode(
        {"op": "put", "iter": 0, "indices": [4], "columns": {"reward": {"ragged": False, "lengths": None}}},
        [torch.tensor([1.5])],
    )
    return [bytes(f) for f in seal(KEY, b"req", frames)]


def _sealed(draw, frames: list[bytes]) -> list[bytes]:
    """The frames as the job would send them, with a wrong key, with a garbage MAC, or bare."""
    how = draw(st.sampled_from(["job", "wrong", "garbage", "bare"]))
    if how == "job":
        return seal(KEY, b"req", frames)
    if how == "wrong":
        return seal(WRONG_KEY, draw(st.sampled_from([b"req", b"rep"])), frames)
    return ([draw(st.binary(min_size=32, max_size=32))] if how == "garbage" else []) + frames


@st.composite
def hostile(draw):
    kind = draw(st.sampled_from(["random", "header", "mutated", "reflected"]))
    if kind == "random":
        return draw(st.lists(st.binary(max_size=64), min_size=1, max_size=3))
    if kind == "header":
        head = msgpack.packb(draw(header), use_bin_type=True)
        return _sealed(draw, [head] + draw(st.lists(st.binary(max_size=32), max_size=3)))
    if kind == "reflected":  # a valid put sealed as a reply: must not authenticate as a request
        return seal(KEY, b"rep", _valid_put()[1:])
    frames = [bytearray(f) for f in _valid_put()]
    rng = random.Random(draw(st.integers(0, 2**32)))
    for _ in range(draw(st.integers(1, 6))):
        f = frames[rng.randrange(len(frames))]
        f[rng.randrange(len(f))] = rng.randrange(256)
    return [bytes(f) for f in frames]


@settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(frames=hostile())
def test_hostile_frames_do_not_stop_the_warehouse(live, frames):
    server, client, raw = live
    _send(raw, frames)
    _still_serving(server, client)


def test_refusals_counted(live):
    server, client, raw = live
    before = server.refused
    huge = msgpack.packb({"op": "put", "tensors": [{"dtype": "float64", "shape": [2**20, 2**20]}]})
    for _ in range(200):  # declared 8 TiB each, wrong key: the header is never parsed
        _send(raw, seal(WRONG_KEY, b"req", [huge, b"\0" * 64]))
    assert server.refused >= before + 200
    _send(raw, [b"\0" * (MAX_MSG + 1)])  # over zmq.MAXMSGSIZE: the peer is dropped, nothing read
    _still_serving(server, client)
    assert server.refusals and all(v > 0 for counts in server.refusals.values() for v in counts.values())


def test_client_refuses_a_put_bigger_than_the_limit(live):
    server, client, _ = live
    from spmd_rl.dock.errors import DockRequestError

    with pytest.raises(DockRequestError, match="dock.max_message_bytes"):
        client.put(1, [0], {"response_ids": [torch.zeros(MAX_MSG, dtype=torch.int32)]}, {"response_ids": True})
    _still_serving(server, client)


@pytest.mark.parametrize(
    "meta",
    [
        {"dtype": ["float32"], "shape": [1]},  # unhashable dtype: killed the old server thread
        {"dtype": "float32", "shape": [2**32, 2**32]},  # np.prod overflowed to 0 and passed the byte check
        {"dtype": "float32", "shape": [True]},
    ],
)
def test_frames_that_killed_the_old_server(live, meta):
    server, client, raw = live
    head = {"op": "put", "iter": 1, "indices": [0], "columns": {"x": {"ragged": False}}, "tensors": [meta]}
    frames = [msgpack.packb(head), b""]
    for message in (frames, seal(KEY, b"req", frames)):  # unauthenticated, and authenticated but invalid
        _send(raw, message)
        _still_serving(server, client)


SERVER = f"""
import sys
from spmd_rl.dock.warehouse import WarehouseServer
server = WarehouseServer("127.0.0.1", 0, {TOKEN!r}, bucket_bytes=1 << 16, max_message_bytes={MAX_MSG}).start()
print(server.address, flush=True)
sys.stdin.read()  # until the test closes our stdin
server.stop()
"""


def _peak_rss_kib(pid: int) -> int:
    status = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status").read().splitlines())
    return int(status["VmHWM"].split()[0])


def test_memory_of_a_fresh_server_stays_bounded():
    """The server alone in its own process (no pytest, no other test's allocations): 200 small
    frames declaring 8 TiB each and one frame over the message limit raise its peak RSS by less
    than 64 MiB, and it still serves."""
    from tests.conftest import subprocess_env

    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=subprocess_env()
    )
    try:
        address = proc.stdout.readline().strip()
        client = WarehouseClient(address, TOKEN, timeout_s=10, max_message_bytes=MAX_MSG)
        client.put(0, [3], {"response_ids": [SAMPLE]}, {"response_ids": True})
        raw = zmq.Context.instance().socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(address)
        peak0 = _peak_rss_kib(proc.pid)
        huge = msgpack.packb({"op": "put", "tensors": [{"dtype": "float64", "shape": [2**20, 2**20]}]})
        for _ in range(100):
            _send(raw, seal(WRONG_KEY, b"req", [huge, b"\0" * 64]))
            _send(raw, seal(KEY, b"req", [huge, b"\0" * 64]))  # with the job's key: the shape check refuses it
        _send(raw, [b"\0" * (MAX_MSG + 1)])
        grew = _peak_rss_kib(proc.pid) - peak0
        assert torch.equal(client.get(0, [3], ["response_ids"])["response_ids"][0], SAMPLE)
        print(f"server peak RSS grew {grew} KiB over 201 hostile frames")
        assert grew * 1024 < 64 << 20
        assert client.stats()["samples"] == 1
        raw.close()
        client.close()
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
