"""Wire format: bit-exact round trips, and refusal of malformed or hostile frames."""

from __future__ import annotations

import msgpack
import pytest
import torch

from spmd_rl.dock.wire import DTYPES, WireError, decode, encode


@pytest.mark.parametrize("dtype", list(DTYPES.values()))
def test_round_trip_bit_exact(dtype):
    raw = torch.randint(0, 256, (3, 5, 8), dtype=torch.uint8)
    t = raw.view(dtype) if dtype != torch.bool else raw.bool()
    head, (back,) = decode([bytes(f) for f in encode({"op": "x"}, [t])])
    assert head == {"op": "x"}
    assert back.dtype == t.dtype and back.shape == t.shape
    assert torch.equal(back.view(torch.uint8), t.contiguous().view(torch.uint8))


def test_non_contiguous_and_empty():
    t = torch.arange(12, dtype=torch.int32).reshape(3, 4).t()
    e = torch.empty(0, 7)
    _, (a, b) = decode([bytes(f) for f in encode({}, [t, e])])
    assert torch.equal(a, t) and b.shape == (0, 7)


@pytest.mark.parametrize(
    "frames",
    [
        [b"\xc1"],  # invalid msgpack
        [msgpack.packb([1, 2])],  # not a map
        [msgpack.packb({"tensors": [{"dtype": "object", "shape": [1]}]}), b"\0" * 8],  # unknown dtype
        [msgpack.packb({"tensors": [{"dtype": "float32", "shape": [3]}]}), b"\0" * 8],  # wrong byte count
        [msgpack.packb({"tensors": [{"dtype": "float32", "shape": [-1]}]}), b""],  # negative dim
        [msgpack.packb({"tensors": []}), b"extra"],  # more buffers than metas
    ],
)
def test_malformed_frames_refused(frames):
    with pytest.raises(WireError):
        decode(frames)


def test_complex_dtype_cannot_be_sent():
    with pytest.raises(WireError):
        encode({}, [torch.zeros(2, dtype=torch.complex64)])


def test_auth_round_trip_and_tampering():
    """The MAC covers every frame and the direction; the token is nowhere in the frames."""
    from spmd_rl.dock.auth import job_key, seal, verify

    token = "wire-test-token-0123456789abcdef"
    key = job_key(token)
    frames = [bytes(f) for f in encode({"op": "put", "iter": 1}, [torch.arange(5)])]
    sealed = seal(key, b"req", frames)
    assert verify(key, b"req", sealed)
    assert not verify(key, b"rep", sealed)  # a request is no reply
    assert not verify(job_key("another-token-0123456789abcdef"), b"req", sealed)
    assert not any(token.encode() in bytes(f) for f in sealed)
    for k in range(len(sealed)):  # one flipped bit anywhere fails
        bad = [bytearray(f) for f in sealed]
        bad[k][0] ^= 1
        assert not verify(key, b"req", [bytes(f) for f in bad])
    assert not verify(key, b"req", sealed[:1]) and not verify(key, b"req", frames)
    # frame boundaries are authenticated: moving bytes between frames changes the MAC
    assert not verify(key, b"req", [sealed[0], sealed[1] + sealed[2][:1], sealed[2][1:]])
