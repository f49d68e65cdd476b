"""Reading the files a user points at, with one clear error naming the file (and line) when a
file is not what its name says: prompt datasets (.jsonl / .parquet) and safetensors weights.

``sniff_*`` are cheap checks for ``spmd-rl validate`` (they read a few bytes or the first
line); ``read_jsonl`` / ``read_parquet`` read whole files and fail on the first bad row.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path


class BadFile(ValueError):
    """A file that cannot be what its name says; the message names the file and the fix."""


def read_jsonl(path: str | Path) -> list[dict]:
    rows = []
    with open(path, "rb") as f:
        for no, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8").strip()
                if not line:
                    continue
                row = json.loads(line)
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise BadFile(
                    f"{path}: line {no} is not a UTF-8 JSON object ({exc}); fix or remove that line"
                ) from None
            if not isinstance(row, dict):
                raise BadFile(
                    f"{path}: line {no} is a JSON {type(row).__name__}, not an object with the prompt/answer columns"
                )
            rows.append(row)
    return rows


def read_parquet(path: str | Path) -> list[dict]:
    import pyarrow
    import pyarrow.parquet as pq

    try:
        return pq.read_table(str(path)).to_pylist()
    except (pyarrow.ArrowException, OSError) as exc:
        raise BadFile(f"{path}: not a readable parquet file ({exc}); re-export it") from None


def sniff_dataset(path: str | Path) -> str | None:
    """None if the first bytes look right for the extension, else the problem."""
    p = Path(path)
    if p.suffix == ".parquet":
        size = p.stat().st_size
        with open(p, "rb") as f:
            head = f.read(4)
            f.seek(max(0, size - 4))
            tail = f.read(4)
        return None if size >= 12 and head == tail == b"PAR1" else "not a parquet file (no PAR1 magic at both ends)"
    with open(p, "rb") as f:
        for raw in f:
            if raw.strip():
                try:
                    row = json.loads(raw.decode("utf-8"))
                except (UnicodeDecodeError, json.JSONDecodeError):
                    return "the first line is not a UTF-8 JSON object"
                return None if isinstance(row, dict) else "the first line is not a JSON object"
    return "empty file"


def safetensors_header(path: str | Path) -> tuple[int, dict]:
    """(offset of the data, header) of a safetensors file; ValueError naming the problem if the
    header does not parse or the file is shorter than the tensors it declares."""
    p = Path(path)
    size = p.stat().st_size
    with open(p, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError("shorter than a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > min(size - 8, 100 << 20):
            raise ValueError(f"declares a {n}-byte header in a {size}-byte file")
        try:
            header = json.loads(f.read(n).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise ValueError("the header is not JSON") from None
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    ends = [
        v["data_offsets"][1]
        for k, v in header.items()
        if k != "__metadata__" and isinstance(v, dict) and "data_offsets" in v
    ]
    need = 8 + n + max(ends, default=0)
    if size < need:
        raise ValueError(f"truncated: {size} bytes, the header needs {need}")
    return 8 + n, header


def check_safetensors(path: str | Path) -> str | None:
    """None if the file's header parses and the file holds every tensor it declares (a
    truncated copy does not), else the problem."""
    try:
        safetensors_header(path)
    except ValueError as exc:
        return str(exc)
    return None
