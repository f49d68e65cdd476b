#!/usr/bin/env bash
# One node: validate, start an embedded etcd, run torchrun with every local rank.
#   launch/single_node.sh CONFIG [key=value ...]
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/spmd-rl train "$@"
