#!/usr/bin/env bash
# One node: validate, start an embedded etcd, run torchrun with every local rank.
#   launch/single_node.sh CONFIG [key=value ...]
# PYTHON picks the interpreter that has spmd-rl installed (default: python3 on PATH, so an
# activated venv, conda env or container's Python).
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" -m spmd_rl.cli train "$@"
