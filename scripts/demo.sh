#!/usr/bin/env bash
# README command 1: install ddtree-deploy (editable) and run the sandbox demo on a local two-host fleet.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -e . 2>&1 | grep -v -e "^WARNING: Running pip as the 'root' user" -e "^$" || true
exec python3 -m sandbox.demo "$@"
