# Sourced by demo.sh and test.sh (from the checkout's root): the checkout's own virtual environment, and
# apt_install for what Debian must provide.
#
# `use_venv EXTRAS` makes .venv/ with `python3 -m venv` (or reuses it), installs this checkout into it
# (editable, with EXTRAS such as "[test]"), and puts its bin/ first on PATH, so everything after runs
# from it: a python that refuses `pip install` outside a venv (PEP 668, Debian's python3) is never
# asked to. Debian's python3 makes venvs only with python3-venv; it is installed when missing (as root,
# else with sudo), as test.sh installs openssh-server. DDTREE_VENV names another folder.

VENV=${DDTREE_VENV:-$PWD/.venv}

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

apt_install() {  # Debian's packages, quietly
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

make_venv() {
  if ! python3 -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
    echo "error: ddtree-deploy needs Python 3.10 or newer as python3 (found: $(python3 --version 2>&1))" >&2
    return 1
  fi
  if python3 -m venv "$VENV" >/dev/null 2>&1; then return 0; fi
  rm -rf "$VENV"  # a venv without pip: Debian's python3 lacks ensurepip until python3-venv is installed
  echo "== installing python3-venv (python3 -m venv needs it on Debian and Ubuntu)"
  apt_install python3-venv
  python3 -m venv "$VENV"
}

use_venv() {
  local extras=${1:-} stamp
  if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c '' 2>/dev/null; then
    echo "== creating $VENV (python3 -m venv)"
    make_venv || return 1
  fi
  # Installed again only when what it installs changed (pyproject.toml, or extras not installed yet).
  stamp="$(sha256sum pyproject.toml | cut -d' ' -f1) $extras"
  if ! grep -qxF "$stamp" "$VENV/.ddtree-installed" 2>/dev/null; then
    echo "== pip install -e '.$extras' into $VENV"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".$extras" || return 1
    echo "$stamp" >> "$VENV/.ddtree-installed"
  fi
  export PATH="$VENV/bin:$PATH" VIRTUAL_ENV="$VENV"
  hash -r
}
