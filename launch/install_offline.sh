#!/usr/bin/env bash
# Install an offline bundle of tools/offline_bundle.py on a node with no package index.
#   bash install_offline.sh describe > node.json        what to make the bundle for (run on the node)
#   bash install_offline.sh install BUNDLE [--target DIR]
# checks every part's sha256, reassembles the wheels into BUNDLE/wheels/ and installs them with
# pip --no-index --no-deps, leaving the node's torch and every other package of its own alone.
# PYTHON picks the node's interpreter (default python3). Exit 2: a missing or damaged part, or a
# node the bundle was not made for; the message names it and the fix (launch/offline_install.py).
set -euo pipefail
exec "${PYTHON:-python3}" "$(dirname "$0")/offline_install.py" "$@"
