"""What vLLM says on a run's terminal: its errors and the warnings about the user's run. Its
expected chatter goes only to the run folder (``<logging.dir>/vllm-rank<r>.log``, every vLLM
record at INFO and above).

vLLM configures no handler of its own here (``VLLM_CONFIGURE_LOGGING=0``, set before vLLM is
imported), so its records reach the rank's root handler, where ``TerminalFilter`` drops:

- every vLLM record below WARNING (INFO about Triton, platforms, model loading);
- the warnings in ``EXPECTED``, each with the reason it is expected on every run;
- ``Failed to load weights`` from vLLM's layerwise reload, but only for the two layers where
  it is expected after every weight sync (``EXPECTED_RELOAD_MISSES``): the tied LM head, whose
  weight is the embedding's storage (refreshed with the embedding; no tensor of its own
  arrives), and the rotary embedding, which has no weights (a cos/sin cache computed from the
  config). Any other layer that loads nothing stays on the terminal.
  ``tests/unit/test_vllm_logs.py`` and the engine worker check both reasons on a real engine.

Any other vLLM warning stays on the terminal. Python warnings that third-party code raises
at every start (``EXPECTED_PY_WARNINGS``) are ignored the same way.
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path

RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
RELOAD_MISS = "%s: Failed to load weights"
EXPECTED_RELOAD_MISSES = {"ParallelLMHead", "RotaryEmbedding"}

EXPECTED: tuple[tuple[str, str, str], ...] = (
    (
        "vllm.engine.arg_utils",
        "The global random seed is set",
        "the in-process engine shares the rank's process; the trainer seeds it",
    ),
    (
        "vllm.engine.arg_utils",
        "This model does not officially support disabling chunked prefill",
        "CPU engines prefill whole prompts: CPU generators cannot rewind a chunked prefill's seeded sample "
        "(engines.vllm.options)",
    ),
    ("vllm.config.vllm", "Enforce eager set", "rollout.vllm.enforce_eager (the default) says so"),
    ("vllm.config.vllm", "Inductor compilation was disabled", "follows from rollout.vllm.enforce_eager"),
    ("vllm.config.vllm", "Model Runner V2 requires Triton", "vLLM CPU has no Triton; the V1 runner is the tested one"),
    ("vllm.platforms.cpu", "Triton is not installed", "vLLM CPU has no Triton backend"),
    (
        "vllm.platforms.cpu",
        "Reset SSM cache type to float32",
        "CPUs with AVX512-BF16 only: vLLM sets the SSM state dtype of its "
        "accelerated mamba backend; these decoders have no SSM layers",
    ),
    ("vllm.triton_utils.importing", "Triton is installed", "vLLM CPU has no Triton backend"),
    (
        "vllm.v1.worker.cpu_worker",
        "libtcmalloc is not found in LD_PRELOAD",
        "a performance hint; see docs/benchmarks.md",
    ),
    ("vllm.v1.worker.cpu_worker", "libiomp is not found in LD_PRELOAD", "a performance hint; see docs/benchmarks.md"),
    (
        "vllm.v1.worker.cpu_worker",
        "CPU backend doesn't allow to use `torch.set_num_threads`",
        "vLLM pins the rank's threads; the trainer's set_num_threads calls are no-ops",
    ),
)
"""(logger, message start, why it is expected): vLLM warnings every CPU run prints."""

EXPECTED_TORCH: tuple[tuple[str, str, str], ...] = (
    (
        "torch._library.triton",
        "Triton not available",
        "vLLM CPU has no Triton; torch says so once on its own handler when vLLM asks for kernels",
    ),
)
"""(logger, message start, why): torch's records of the same kind, dropped from torch's own handler."""

EXPECTED_PY_WARNINGS: tuple[tuple[str, type[Warning], str, str], ...] = (
    (
        r"`torch\.distributed\.reduce_op` is deprecated",
        FutureWarning,
        r"vllm\.triton_utils",
        "vLLM's Triton dispatcher walks torch.distributed's attributes, touching the deprecated alias",
    ),
)
"""(message regex, category, module regex, why): Python warnings ignored."""


class TerminalFilter(logging.Filter):
    """Keeps a record on the terminal unless it is vLLM chatter (module docstring)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.startswith("torch"):
            text = record.getMessage()
            return not any(record.name == name and text.startswith(start) for name, start, _ in EXPECTED_TORCH)
        if not record.name.startswith("vllm"):
            return True
        if record.levelno < logging.WARNING:
            return False
        if record.name == RELOAD_LOGGER and record.msg == RELOAD_MISS:
            return not (record.args and record.args[0] in EXPECTED_RELOAD_MISSES)
        text = record.getMessage()
        return not any(record.name == name and text.startswith(start) for name, start, _ in EXPECTED)


QUIET_ENV = {"VLLM_CONFIGURE_LOGGING": "0"}
"""What ``quiet_vllm`` sets before vLLM is imported (a preload server imports vLLM with it)."""


def quiet_vllm(log_dir: str | Path | None, rank: int) -> None:
    """Before vLLM is imported: no handler of vLLM's own, every vLLM record at INFO and above to
    ``log_dir/vllm-rank<rank>.log`` (when given), the chatter kept off the root handlers."""
    os.environ.update(QUIET_ENV)
    vllm = logging.getLogger("vllm")
    vllm.setLevel(logging.INFO)
    if log_dir is not None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(Path(log_dir) / f"vllm-rank{rank}.log")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        vllm.addHandler(handler)
    import torch  # noqa: F401  (its import gives the "torch" logger its own handler, which does not propagate)

    for handler in logging.getLogger().handlers + logging.getLogger("torch").handlers:
        handler.addFilter(TerminalFilter())
    for message, category, module, _ in EXPECTED_PY_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
