#!/usr/bin/env bash
# README command 2, and CI's (.ci/run): install what the tests need, then lint, type-check and run the whole suite.
#
# Installs OpenSSH's server from Debian's packages when /usr/sbin/sshd is missing (the integration tests start
# real sshd on 127.0.0.1 and FAIL without it), then the package with its test and overlay-dev extras. The
# sglang 0.5.17 wheel for the simulated hosts is downloaded by the test fixtures on first use and cached in
# ~/.cache/ddtree-deploy/. Every step runs even if an earlier check failed; the exit code is non-zero if any did.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh tests/integration -x`).
set -uo pipefail
cd "$(dirname "$0")/.."

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

set -e
if [ ! -x /usr/sbin/sshd ] || ! command -v ssh-keygen >/dev/null; then
  echo "== installing openssh-server (the integration tests run real sshd)"
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server openssh-client >/dev/null
fi
echo "== pip install -e '.[test,overlay-dev]'"
python3 -m pip install -q --root-user-action=ignore --disable-pip-version-check -e '.[test,overlay-dev]'
set +e

failed=()
step() {
  local name=$1; shift
  echo "== $name"
  "$@" || failed+=("$name")
}
step "ruff check" python3 -m ruff check --output-format=concise .
step "mypy ddtree_deploy" python3 -m mypy ddtree_deploy
step "overlay check" python3 -m ddtree_deploy.cli overlay check   # every overlay against its pristine releases
step "pytest" python3 -m pytest -q --timeout=600 "$@"

if [ ${#failed[@]} -gt 0 ]; then
  echo "== FAILED: ${failed[*]}"
  exit 1
fi
echo "== all checks passed"
