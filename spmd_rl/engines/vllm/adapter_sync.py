"""Adapter-only weight sync (``actor.lora.sync: adapter``): vLLM's LoRA serves the actor's
adapters over the base weights it loaded once.

Each sync writes the adapters, gathered whole on every rank, as a PEFT folder
(``adapter_model.safetensors`` + ``adapter_config.json``). It writes them to a private
directory in host memory (``/dev/shm`` when present, mode 0700, one per rank, so TP ranks on
one node never share a file; named per job so an elastic restart removes a killed rank's). The engine then gets a new
``LoRARequest``, a fresh id per
version, and the previous one is removed from vLLM. Every request the engine enqueues carries
the current request (``VllmRollout.submit``).

Invariants:

- the engine's policy is the base weights + (alpha / r) B A of the latest published adapters,
  the trainer's (vLLM's log-probs equal the trainer's: ``tests/integration/test_lora.py``);
- a published version is never overwritten: a new version has a new id and a new folder, so
  vLLM's cache cannot serve stale adapters under a reused id;
- a sleep makes the adapters stale (``stale``): vLLM may lose its LoRA buffers across sleep and
  wake (verl #7434), so the next sync publishes again even when the actor has not moved.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import torch

from spmd_rl.engines.training import lora
from spmd_rl.engines.vllm import shm as vllm_shm


ROOT_PREFIX = "spmd-rl-lora-"


def adapter_root() -> Path:
    """This process's adapter folder: in ``/dev/shm`` where present, named by what stays the
    same across the job's restarts on this host (``vllm_shm.JOB_ENV`` without the restart count)
    and its global rank, so a restarted rank removes what a SIGKILLed one left (``spmd-rl
    doctor`` counts what no restart cleaned)."""
    tag = vllm_shm.job_tag(tuple(k for k in vllm_shm.JOB_ENV if k != "TORCHELASTIC_RESTART_COUNT"))
    base = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())
    return base / f"{ROOT_PREFIX}{tag}-r{os.environ.get('RANK', '0')}"


class AdapterSync:
    def __init__(self, base: str | Path, rank: int, alpha: float, targets: list[str]):
        self.base, self.rank, self.alpha, self.targets = str(base), rank, alpha, list(targets)
        self.root = adapter_root()
        shutil.rmtree(self.root, ignore_errors=True)  # a killed predecessor's (an elastic restart of this job)
        self.root.mkdir(mode=0o700, parents=True)
        self.version = 0
        self.request = None
        """The ``LoRARequest`` every request carries; None until the first publish."""
        self.stale = True
        atexit.register(self.close)

    def publish(self, adapters: dict[str, torch.Tensor], llm) -> None:
        """Serve ``adapters`` ({``<linear>.lora_A`` / ``.lora_B``: full tensor}) from now on."""
        from vllm.lora.request import LoRARequest

        self.version += 1
        folder = self.root / f"v{self.version}"
        lora.write_peft_folder(folder, adapters, self.base, self.rank, self.alpha, 0.0, self.targets)
        old, self.request = self.request, LoRARequest(f"spmd-rl-v{self.version}", self.version, str(folder))
        if old is not None:
            llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)
        self.stale = False

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
