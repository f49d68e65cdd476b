#!/usr/bin/env bash
# Issue 49's acceptance run on one GPU node, as one prepared script: install from an offline
# bundle, build the realistic model's weights, then each check under its own time limit. A failed
# step is recorded and the next one runs, so one failure does not spend the device time of the
# rest. PREPARED ON CPU, NOT YET RUN ON A DEVICE: its first run is the acceptance run.
#
# Here, where PyPI is reachable (describe.json: `python3 launch/offline_install.py describe` on
# the node; the image's own package list otherwise):
#   python tools/offline_bundle.py 'trl==1.16.*' --extra cuda --build python-etcd --replace numpy \
#       --exclude pynvvideocodec --exclude nvidia-cutlass-dsl-libs-cu12 --node describe.json --out .bundle
#   python tools/make_gpu_model.py --out assets/gpu-qwen2.5-1.5b        # tokenizer and prompts (14 MB)
# then carry each .bundle/part-NNN in its own call (add /.bundle/ to .git/info/exclude), the
# tiny models (assets/tiny-qwen2, for gpu_smoke) and assets/gpu-qwen2.5-1.5b, and run there:
#   bash tools/gpu_acceptance.sh .bundle "$OUT"
# Each step writes OUT/<step>.log; OUT/status.tsv has one line per step: name, exit status, seconds.
set -uo pipefail
BUNDLE=${1:?usage: gpu_acceptance.sh BUNDLE OUT}
OUT=${2:?usage: gpu_acceptance.sh BUNDLE OUT}
SITE=${SITE:-/tmp/spmd-rl-site}
MODEL=assets/gpu-qwen2.5-1.5b
CONFIG=configs/gpu_qwen25_1_5b.yaml
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

step() {  # step NAME SECONDS COMMAND...: run, log, record; never stops the script
    local name=$1 limit=$2 t=$SECONDS
    shift 2
    printf '[acceptance] %s (limit %d s)\n' "$name" "$limit"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    printf '%s\t%d\t%d\n' "$name" "$rc" $((SECONDS - t)) | tee -a "$OUT/status.tsv"
    return $rc
}

step install 180 python3 launch/offline_install.py install "$BUNDLE" --target "$SITE" || exit 1
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
step versions 60 python3 -m spmd_rl.cli doctor "$CONFIG"
step weights 120 python3 tools/make_gpu_model.py --out "$MODEL" --weights --device cuda || exit 1
step plan 60 python3 -m spmd_rl.cli plan "$CONFIG"
step smoke 300 python3 tools/gpu_smoke.py --nproc-per-node 1 --out "$OUT/smoke"
step run 420 python3 -m spmd_rl.cli train "$CONFIG" "logging.dir=$OUT/run/logs" "checkpoint.dir=$OUT/run/ckpt" \
    logging.progress=false
step trl 420 python3 tools/bench_trl.py "$CONFIG" --mode vllm --steps 6
step update 300 python3 tools/bench_update.py --hidden 1536 --layers 28 --heads 12 --kv-heads 2 --vocab 151936 \
    --samples 16 --prompt 256 --response 1024 --micro 4 --checkpointing --json "$OUT/update.json"
# the megatron backend's SDPA core attention against mcore's unfused local module at 16 k tokens
step attention 180 python3 tools/bench_update.py --hidden 1536 --layers 4 --heads 12 --kv-heads 2 --vocab 151936 \
    --samples 2 --prompt 256 --response 16384 --micro 1 --steps 2 --rounds 1 --backends megatron,megatron-local \
    --json "$OUT/attention.json"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/device.csv" 2>&1
python3 -c "import torch, vllm, transformers; print(torch.__version__, vllm.__version__, transformers.__version__)" \
    > "$OUT/versions.txt" 2>&1
cat "$OUT/status.tsv"
