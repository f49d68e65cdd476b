#!/usr/bin/env bash
# One node of a multi-node (elastic) job. Run the same line on every node; start the etcd
# first (launch/etcd.sh). torchrun's etcd-v2 rendezvous survives losing any node (c10d's store
# dies with the node that hosts it), --nnodes MIN:MAX lets the job shrink and grow, and
# --max-restarts bounds the restarts after failures. LAST_CALL_S (default 3) is how long a
# rendezvous waits for more nodes once MIN are there: it adds to every recovery after a node
# loss, and nodes that start further apart than that join with one extra restart.
# KEEP_ALIVE_S (default 5, torch's) is how often each agent renews its rendezvous heartbeat; a
# node that missed three is dropped from the rendezvous, so a lost node's peers wait up to
# 3 x KEEP_ALIVE_S before they re-form the group without it.
#
#   ETCD=10.0.0.1:2379 JOB=run1 NNODES=1:4 NPROC=8 INTERFACE=10.0.0.12 TOKEN=... \
#       launch/multi_node.sh CONFIG [key=value ...]
#
# For an etcd with TLS and client-certificate auth (launch/etcd.sh with TLS_DIR) also set
# ETCD_CA, ETCD_CERT and ETCD_KEY: torchrun's rendezvous and the ranks then use TLS.
#
# PYTHON picks the interpreter that has spmd-rl installed (default: python3 on PATH).
#
# Leave parallel.train.dp_shard and parallel.gen.dp out of the config so both layouts are
# re-derived from the world size after every (re)start, and put checkpoint.dir on storage all
# nodes share: each restart resumes from the latest complete checkpoint.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${ETCD:?set ETCD=host:port of the job's etcd}"
: "${TOKEN:?set TOKEN to the job's secret (same on every node)}"
JOB=${JOB:-spmd-rl}
NNODES=${NNODES:-1:2}
NPROC=${NPROC:-1}
RESTARTS=${RESTARTS:-3}
INTERFACE=${INTERFACE:-127.0.0.1}
CONFIG=$1
shift
RDZV_CONF="last_call_timeout=${LAST_CALL_S:-3},timeout=${RDZV_TIMEOUT_S:-300},keep_alive_interval=${KEEP_ALIVE_S:-5}"
TLS_ARGS=()
if [ -n "${ETCD_CA:-}" ]; then
  : "${ETCD_CERT:?set ETCD_CERT and ETCD_KEY with ETCD_CA}" "${ETCD_KEY:?set ETCD_KEY}"
  RDZV_CONF+=",protocol=https,ca_cert=$ETCD_CA,ssl_cert=$ETCD_CERT,ssl_cert_key=$ETCD_KEY"
  TLS_ARGS=("metadata.ca_file=$ETCD_CA" "metadata.cert_file=$ETCD_CERT" "metadata.key_file=$ETCD_KEY")
fi
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1  # torch 2.13 hangs re-forming the group after a restart without it
export SPMD_RL_ETCD=$ETCD SPMD_RL_JOB_TOKEN=$TOKEN OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "${PYTHON:-python3}" -m torch.distributed.run \
    --nnodes="$NNODES" --nproc-per-node="$NPROC" --max-restarts="$RESTARTS" \
    --rdzv-backend=etcd-v2 --rdzv-endpoint="$ETCD" --rdzv-id="$JOB" \
    --rdzv-conf="$RDZV_CONF" \
    -m spmd_rl.train "$CONFIG" "metadata.job=$JOB" "dock.interface=$INTERFACE" \
    "elastic.rdzv_backend=etcd-v2" "elastic.rdzv_endpoint=$ETCD" "elastic.rdzv_last_call_s=${LAST_CALL_S:-3}" "${TLS_ARGS[@]}" "$@"
