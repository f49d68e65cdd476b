#!/usr/bin/env bash
# Issue 49's acceptance run on one GPU node, as one prepared script: install from an offline
# bundle, build the realistic model's weights, then each check, most valuable first, within one
# budget (BUDGET_S, default 720 s, the install included: tools/gpu_acceptance.py schedules them and
# says why). A failed step is recorded and the next one runs. PREPARED ON CPU, NOT YET RUN ON A
# DEVICE: its first run is the acceptance run. Rehearse the schedule on CPU:
#   python tools/gpu_acceptance.py BUNDLE OUT --rehearse 0.01
#
# Here, where PyPI is reachable (describe.json: `python3 launch/offline_install.py describe` on
# the node; the image's own package list otherwise):
#   python tools/offline_bundle.py 'trl==1.16.*' --extra cuda --build python-etcd --replace numpy \
#       --exclude pynvvideocodec --exclude nvidia-cutlass-dsl-libs-cu12 --node describe.json --out .bundle
#   python tools/make_gpu_model.py --out assets/gpu-qwen2.5-1.5b        # tokenizer and prompts (14 MB)
# then carry each .bundle/part-NNN in its own call (add /.bundle/ to .git/info/exclude), the
# tiny models (assets/tiny-qwen2, for gpu_smoke) and assets/gpu-qwen2.5-1.5b, and run there:
#   bash tools/gpu_acceptance.sh .bundle "$OUT"
# Each step writes OUT/<step>.log; OUT/status.tsv gets one line per step as it ends: name, exit
# status (or skip), seconds, limit.
set -uo pipefail
BUNDLE=${1:?usage: gpu_acceptance.sh BUNDLE OUT}
OUT=${2:?usage: gpu_acceptance.sh BUNDLE OUT}
SITE=${SITE:-/tmp/spmd-rl-site}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
# first, so that a run the device's own limit cuts off still says which card it ran on
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/device.csv" 2>&1
python3 tools/gpu_acceptance.py "$BUNDLE" "$OUT" --site "$SITE" --budget-s "${BUDGET_S:-720}"
rc=$?
PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" python3 -c \
    "import torch, vllm, transformers; print(torch.__version__, vllm.__version__, transformers.__version__)" \
    > "$OUT/versions.txt" 2>&1
cat "$OUT/status.tsv"
exit $rc
