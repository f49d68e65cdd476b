#!/usr/bin/env bash
# Certificates for a TLS etcd with client-certificate auth (launch/etcd.sh with TLS_DIR):
#   launch/make_certs.sh DIR HOST [HOST ...]
# writes DIR/ca.{crt,key} (the job's CA), DIR/server.{crt,key} (for etcd, valid for every HOST:
# IP addresses or DNS names) and DIR/client.{crt,key} (for the ranks and torchrun). Copy ca.crt
# and the client pair to every node; keep ca.key off them. Existing files are kept. (etcd also
# uses its server certificate as a client of its own gateway, hence clientAuth on it.)
set -euo pipefail
DIR=${1:?usage: make_certs.sh DIR HOST [HOST ...]}
shift
[ $# -gt 0 ] || { echo "make_certs.sh: name at least one HOST the etcd is reached at" >&2; exit 2; }
mkdir -p "$DIR"
cd "$DIR"
umask 077
SAN=""
for h in "$@"; do
  if [[ $h =~ ^[0-9.]+$ || $h == *:* ]]; then SAN+="IP:$h,"; else SAN+="DNS:$h,"; fi
done
SAN=${SAN%,}
[ -f ca.key ] || openssl req -x509 -newkey rsa:2048 -nodes -days 365 -subj "/CN=spmd-rl etcd CA" \
    -keyout ca.key -out ca.crt 2>/dev/null
sign() {  # name CN extensions
  [ -f "$1.key" ] && return 0
  openssl req -newkey rsa:2048 -nodes -subj "/CN=$2" -keyout "$1.key" -out "$1.csr" 2>/dev/null
  printf '%s\n' "$3" > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 365 -extfile "$1.ext" -out "$1.crt" 2>/dev/null
  rm -f "$1.csr" "$1.ext"
}
sign server "spmd-rl etcd" "subjectAltName=$SAN
extendedKeyUsage=serverAuth,clientAuth"
sign client "spmd-rl rank" "extendedKeyUsage=clientAuth"
echo "[make_certs] $DIR: ca.crt, server.{crt,key} for $*, client.{crt,key}" >&2
