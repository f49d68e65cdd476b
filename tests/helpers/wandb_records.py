"""The records of a W&B run file (``run-*.wandb``), read without a server: a 7-byte header
(":W&B", magic, version), then LevelDB's log format (32 KiB blocks; each chunk a 7-byte header
of CRC32C, little-endian length and type FULL / FIRST / MIDDLE / LAST; a block tail under 7
bytes is padding), each record a ``wandb_internal_pb2.Record``. wandb >= 0.2x reads it only in
its Go core."""

from __future__ import annotations

from pathlib import Path

BLOCK, HEAD = 32768, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: str | Path) -> list:
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", data[:8]
    out, pending, i = [], b"", HEAD
    while i + HEAD <= len(data):
        left = BLOCK - i % BLOCK
        if left < HEAD:
            i += left
            continue
        length, kind = int.from_bytes(data[i + 4 : i + 6], "little"), data[i + 6]
        chunk = data[i + HEAD : i + HEAD + length]
        i += HEAD + length
        if kind == FULL:
            out.append(chunk)
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            out.append(pending + chunk)
        elif kind == 0 and length == 0:
            i += BLOCK - i % BLOCK  # zero padding to the block's end
    return [wandb_internal_pb2.Record.FromString(c) for c in out]


def history(path: str | Path) -> list[dict]:
    """Every logged row: {key: value} (values as W&B stored them, JSON)."""
    import json

    return [
        {(item.key or "/".join(item.nested_key)): json.loads(item.value_json) for item in r.history.item}
        for r in records(path)
        if r.WhichOneof("record_type") == "history"
    ]


def config_text(path: str | Path) -> str:
    """The run's config (the run record's, and any later update) as key=JSON lines."""
    updates = [
        item
        for r in records(path)
        for kind in [r.WhichOneof("record_type")]
        for item in (r.run.config.update if kind == "run" else r.config.update if kind == "config" else [])
    ]
    return "".join(item.key + "=" + item.value_json + "\n" for item in updates)


def run_name(path: str | Path) -> str:
    return next(r.run.display_name for r in records(path) if r.WhichOneof("record_type") == "run")
