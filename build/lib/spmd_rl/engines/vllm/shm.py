"""vLLM's CPU shared-memory segments, unlinked as soon as every rank has mapped them.

On CPU, vLLM's TP and PP communicators (``vllm.distributed.device_communicators.
cpu_communicator._CPUSHMDistributed``) give each rank one POSIX shared-memory segment,
``/dev/shm/<group name>_<rank>``, created with O_EXCL. The group name is the same in every run
of a job, and only a C++ static destructor at a normal interpreter exit unlinks it. A rank that
ends through ``os._exit`` (``distributed.teardown.exit_after``) or is killed leaves the segment
behind, and the next engine with that name fails at start-up ("create shm in SHMManager
failed. errno: 17").

The names are also the same in every *job*: vLLM derives them from ``VLLM_DIST_IDENT``, which
its CPU worker sets from the distributed init method (``env://`` under torchrun gives "//"),
so two jobs on one host both create ``-tp:0-[0-1]-cpushm_<rank>`` and the second one to start
its engine while the first still holds the name fails with errno 17. ``name_per_job`` appends
``job_tag()`` to vLLM's group name: a digest of what is the same on every rank of one launch
and differs between two launches on one host (the job token, torchrun's run id, master address
and port, and restart count). The rank is already in the segment name.

Invariant: once the in-process engine is built, no segment of this rank's vLLM groups has a
name. vLLM's communicator returns from its set-up only after a barrier that follows every
rank's join, so each rank unlinks its own name then; the mappings stay valid and the kernel
frees the memory when the last rank exits, however it exits.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

SHM_DIR = Path("/dev/shm")


JOB_ENV = ("SPMD_RL_JOB_TOKEN", "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT")


def job_tag(keys: tuple[str, ...] = JOB_ENV) -> str:
    """12 hex digits of sha256 over the environment's ``keys`` (the token is hashed, never shown)."""
    return hashlib.sha256("\0".join(os.environ.get(k, "") for k in keys).encode()).hexdigest()[:12]


def name_per_job() -> None:
    """Make vLLM's CPU communicator name its segments ``<vLLM's name>-<job_tag()>`` (idempotent;
    every rank of a group computes the same tag, which vLLM checks before it uses the segments)."""
    try:
        from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed
    except ImportError:
        return
    vllm_name = _CPUSHMDistributed.make_group_name
    if getattr(vllm_name, "per_job", False):
        return

    def make_group_name(communicator) -> str:
        return f"{vllm_name(communicator)}-{job_tag()}"

    make_group_name.per_job = True
    _CPUSHMDistributed.make_group_name = staticmethod(make_group_name)


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
