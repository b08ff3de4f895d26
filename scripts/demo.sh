#!/usr/bin/env bash
# README command 1: install ddtree-deploy into the checkout's own venv (.venv/, see venv.sh) and run the
# sandbox demo on a local two-host fleet from it. Arguments go to the demo (`--help` lists them).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/venv.sh
use_venv ""
exec python -m sandbox.demo "$@"
