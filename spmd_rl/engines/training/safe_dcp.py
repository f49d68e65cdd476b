"""Loading DCP checkpoints without unpickling arbitrary objects.

torch's ``FileSystemReader`` reads ``.metadata`` with ``pickle.load`` and its load planners read
non-tensor items with ``torch.load(weights_only=False)``: a downloaded checkpoint folder could
run code on ``spmd-rl eval`` / ``export`` / resume. Here:

- ``.metadata`` is unpickled by :class:`MetadataUnpickler`, which resolves only the classes DCP
  metadata is made of (``torch.distributed.checkpoint.metadata``, its storage info,
  ``torch.Size``, torch dtypes and layouts, paths); anything else raises :class:`BadCheckpoint`;
- non-tensor items (LR schedule, step counters) are read with ``torch.load(weights_only=True)``.

Tensor shards were already read with ``weights_only=True`` by torch.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta

_MODULES = {"torch.distributed.checkpoint.metadata"}
_NAMES = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}


class BadCheckpoint(ValueError):
    """A checkpoint folder that spmd-rl did not write (or that was tampered with)."""


class MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        ok = (
            module in _MODULES
            or (module, name) in _NAMES
            or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        )
        if not ok:
            raise BadCheckpoint(
                f".metadata references {module}.{name}, which DCP metadata never does; refusing to unpickle it"
            )
        return super().find_class(module, name)


class SafeReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        try:
            with self.fs.create_stream(path, "rb") as f:
                metadata = MetadataUnpickler(f).load()
        except BadCheckpoint as exc:
            raise BadCheckpoint(f"checkpoint {self.path}: {exc}") from None
        except (pickle.UnpicklingError, EOFError, AttributeError, TypeError) as exc:
            raise BadCheckpoint(f"checkpoint {self.path}: unreadable .metadata ({exc})") from None
        if not isinstance(metadata, Metadata):
            raise BadCheckpoint(
                f"checkpoint {self.path}: .metadata holds a {type(metadata).__name__}, not DCP metadata"
            )
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _safe_bytes(value: io.BytesIO) -> io.BytesIO:
    """Read a non-tensor item with weights_only=True and hand the planner a re-serialised copy
    of the (now known-safe) object, so torch's own unpickling of it runs on our bytes only."""
    try:
        obj = torch.load(value, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as exc:
        raise BadCheckpoint(
            f"a non-tensor checkpoint item holds objects spmd-rl never writes ({str(exc).splitlines()[0]})"
        ) from None
    out = io.BytesIO()
    torch.save(obj, out)
    out.seek(0)
    return out


class SafeLoadPlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        super().load_bytes(read_item, _safe_bytes(value))


class SafeEmptyLoadPlanner(_EmptyStateDictLoadPlanner):
    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        super().load_bytes(read_item, _safe_bytes(value))


def verify(folder: str | Path) -> Metadata:
    """Read ``.metadata`` and every non-tensor item of a checkpoint the safe way, so a tampered
    folder fails here with :class:`BadCheckpoint` (torch would wrap it in its own exception)."""
    folder = Path(folder)
    if not (folder / ".metadata").is_file():
        raise BadCheckpoint(f"checkpoint {folder}: no .metadata (not a DCP checkpoint folder)")
    metadata = SafeReader(str(folder)).read_metadata()
    for index, info in (metadata.storage_data or {}).items():
        if isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            with open(folder / info.relative_path, "rb") as f:
                f.seek(info.offset)
                raw = f.read(info.length)
            try:
                _safe_bytes(io.BytesIO(raw))
            except BadCheckpoint as exc:
                raise BadCheckpoint(f"checkpoint {folder}: item {index.fqn!r}: {exc}") from None
    return metadata


def read_full_state(folder: str | Path) -> dict:
    """The whole state dict of a DCP checkpoint in one process (no process group)."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    verify(folder)
    state: dict = {}
    _load_state_dict(state, storage_reader=SafeReader(str(folder)), planner=SafeEmptyLoadPlanner(), no_dist=True)
    return state


def tensor_shapes(folder: str | Path, prefix: str) -> dict[str, tuple[list[int], torch.dtype]]:
    """(shape, dtype) of every tensor of a checkpoint whose flattened key starts with ``prefix``
    (``"model."``: the actor's weights), the prefix cut off, in the checkpoint's order; from
    the metadata alone."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = verify(folder)
    return {
        key[len(prefix) :]: (list(m.size), m.properties.dtype)
        for key, m in meta.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(m, TensorStorageMetadata)
    }


def read_tensors(
    folder: str | Path, section: str, shapes: dict[str, tuple[list[int], torch.dtype]]
) -> dict[str, torch.Tensor]:
    """Only the tensors ``section.<name>`` of a checkpoint for each name of ``shapes`` (their
    ``tensor_shapes``), one process, no process group, each in its stored dtype: a reader's
    memory is what it asks for, not the checkpoint's."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    wanted = {n: torch.empty(shape, dtype=dtype) for n, (shape, dtype) in shapes.items()}
    _load_state_dict({section: wanted}, storage_reader=SafeReader(str(folder)), planner=SafeLoadPlanner(), no_dist=True)
    return wanted
