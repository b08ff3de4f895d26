#!/usr/bin/env bash
# README command 2, and CI's (.ci/run): install what the tests need, then lint, type-check and run the whole suite.
#
# Installs OpenSSH's server from Debian's packages when /usr/sbin/sshd is missing (the integration tests start
# real sshd on 127.0.0.1 and FAIL without it), then the package with its test and overlay-dev extras into the
# checkout's own venv (.venv/, see venv.sh), and runs every check from it. The sglang 0.5.17 wheel for the
# simulated hosts is downloaded by the test fixtures on first use and cached in ~/.cache/ddtree-deploy/. Every
# step runs even if an earlier check failed; the exit code is non-zero if any did.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh tests/integration -x`).
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/venv.sh
# The checks are of this checkout: a shell set up for some fleet (say `. sandbox-fleet/env.sh`) changes none.
unset DDTREE_INVENTORY DDTREE_OVERLAYS DDTREE_AUDIT_LOG

set -e
if [ ! -x /usr/sbin/sshd ] || ! command -v ssh-keygen >/dev/null; then
  echo "== installing openssh-server (the integration tests run real sshd)"
  apt_install openssh-server openssh-client
fi
use_venv "[test,overlay-dev]"
set +e

failed=()
step() {
  local name=$1; shift
  echo "== $name"
  "$@" || failed+=("$name")
}
step "ruff check" python -m ruff check --output-format=concise .
step "mypy ddtree_deploy" python -m mypy ddtree_deploy
step "overlay check" ddtree-deploy overlay check   # every overlay against its pristine releases
step "pytest" python -m pytest -q --timeout=600 "$@"

if [ ${#failed[@]} -gt 0 ]; then
  echo "== FAILED: ${failed[*]}"
  exit 1
fi
echo "== all checks passed"
