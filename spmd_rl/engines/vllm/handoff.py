"""Where a separated generator hands each policy update to its vLLM engine process (issue 70,
finding 8): one safetensors file (``weight_file``) in shared memory, not on disk.

The file was written under ``TMPDIR``: on a node whose ``/tmp`` is a disk, about 15 GB written
and read back per update for a 7B model in bf16. In ``/dev/shm`` (memory) no byte reaches a disk,
and the engine's ``safe_open`` maps the pages the generator wrote. The folder is named by what
stays the same across the job's restarts on this host and the rank, mode 0700, so a restarted
rank removes what a SIGKILLed one left (as ``adapter_sync`` does for LoRA adapters). Where
``/dev/shm`` is missing or has less free space than the update and ``MARGIN``, the file goes to
``TMPDIR`` as before, and the log says so once.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from spmd_rl.engines.vllm import shm as vllm_shm

log = logging.getLogger("spmd_rl")
SHM = Path("/dev/shm")
PREFIX = "spmd-rl-weights-"
MARGIN = 256 * 2**20
"""Free bytes ``/dev/shm`` keeps beyond the update (NCCL's and vLLM's own segments live there)."""


def update_bytes(meta: list[tuple[str, torch.dtype, list[int]]]) -> int:
    return sum(dtype.itemsize * int(torch.Size(shape).numel()) for _, dtype, shape in meta)


class Handoff:
    """One generator rank's handoff folder (module docstring)."""

    def __init__(self, shm: Path = SHM):
        tag = vllm_shm.job_tag(tuple(k for k in vllm_shm.JOB_ENV if k != "TORCHELASTIC_RESTART_COUNT"))
        self.shm_root = shm / f"{PREFIX}{tag}-r{os.environ.get('RANK', '0')}"
        self.disk_root = Path(tempfile.gettempdir()) / self.shm_root.name
        self.warned = False
        for root in (self.shm_root, self.disk_root):
            shutil.rmtree(root, ignore_errors=True)  # a killed predecessor's (an elastic restart of this job)

    def path_for(self, nbytes: int) -> Path:
        """The file to write an update of ``nbytes`` to: in shared memory when it fits."""
        root = self.shm_root
        try:
            st = os.statvfs(root.parent)
            fits = st.f_bavail * st.f_frsize >= nbytes + MARGIN
        except OSError:
            fits = False
        if not fits:
            root = self.disk_root
            if not self.warned:
                self.warned = True
                log.warning(
                    "%s cannot hold a %.1f GiB weight update: it goes through %s (a disk, written and read on every "
                    "update); docker run --shm-size or mount -o remount,size= makes room",
                    self.shm_root.parent,
                    nbytes / 2**30,
                    root.parent,
                )
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        return root / "weights.safetensors"

    def close(self) -> None:
        for root in (self.shm_root, self.disk_root):
            shutil.rmtree(root, ignore_errors=True)
