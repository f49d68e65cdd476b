"""vLLM's CPU shared-memory segments, unlinked as soon as every rank has mapped them.

On CPU, vLLM's TP and PP communicators (``vllm.distributed.device_communicators.
cpu_communicator._CPUSHMDistributed``) give each rank one POSIX shared-memory segment,
``/dev/shm/<group name>_<rank>``, created with O_EXCL. The group name is the same in every run
of a job, and only a C++ static destructor at a normal interpreter exit unlinks it. A rank that
ends through ``os._exit`` (``distributed.teardown.exit_after``) or is killed leaves the segment
behind, and the next engine with that name fails at start-up ("create shm in SHMManager
failed. errno: 17").

Invariant: once the in-process engine is built, no segment of this rank's vLLM groups has a
name. vLLM's communicator returns from its set-up only after a barrier that follows every
rank's join, so each rank unlinks its own name then; the mappings stay valid and the kernel
frees the memory when the last rank exits, however it exits.
"""

from __future__ import annotations

from pathlib import Path

SHM_DIR = Path("/dev/shm")


def segment_paths() -> list[Path]:
    """The ``/dev/shm`` paths of this rank's vLLM CPU communicator segments (none off CPU, with
    TP = PP = 1, or before vLLM's groups exist)."""
    try:
        from vllm.distributed import parallel_state as ps
    except ImportError:
        return []
    paths = []
    for group in (getattr(ps, "_TP", None), getattr(ps, "_PP", None)):
        shm = getattr(getattr(group, "device_communicator", None), "dist_module", None)
        name, comm = getattr(shm, "group_name", None), getattr(shm, "communicator", None)
        if isinstance(name, str) and comm is not None:
            paths.append(SHM_DIR / f"{name}_{comm.rank}".lstrip("/"))  # shm_open drops the leading slashes
    return paths


def unlink_segment_names() -> None:
    """Unlink this rank's segments by name (the mappings stay)."""
    for path in segment_paths():
        path.unlink(missing_ok=True)
