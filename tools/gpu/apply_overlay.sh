#!/usr/bin/env bash
# Apply one overlay version to a package root by hand (what `ddtree-deploy push` does
# on a host, pip's RECORD aside), then byte-compile what it touched.
#   usage: [SKIP_PATCHES="path.diff ..."] apply_overlay.sh OVERLAY_VERSION_DIR|NAME@VERSION PACKAGE_ROOT [BASE]
# The version is first exported whole (`ddtree-deploy overlay export`: what it inherits resolved
# from its parents; no SSH stack imported, so the GPU machine's python runs it from this checkout).
# Fails if a patch does not apply cleanly (patch -p1 --dry-run first). SKIP_PATCHES leaves out the
# named diffs (paths under patches/BASE/): a planted fault for a GPU check.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
if [ -d "$1" ]; then V=$(cd "$1" && pwd); SPEC="$(basename "$(dirname "$V")")@$(basename "$V")"; FOLDER=$(dirname "$(dirname "$V")")
else SPEC=$1; FOLDER=$REPO/overlays; fi
ROOT=$2; BASE=${3:-0.5.17}
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT; OV=$TMP/version
PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" python3 -m ddtree_deploy.cli overlay export "$SPEC" "$OV" --overlays "$FOLDER" >/dev/null
cd "$ROOT"
# GNU patch if present, else git apply (same -p1 semantics, also outside a repository)
if command -v patch >/dev/null; then check() { patch -p1 --dry-run -s >/dev/null; }; apply() { patch -p1 -s --no-backup-if-mismatch; }
else check() { git apply -p1 --check; }; apply() { git apply -p1; }; fi
DIFFS=(); [ -d "$OV/patches/$BASE" ] && mapfile -t DIFFS < <(cd "$OV/patches/$BASE" && find . -name '*.diff' | sed 's|^\./||' | sort | grep -vxF -f <(printf '%s\n' ${SKIP_PATCHES:-}))
for d in "${DIFFS[@]}"; do check < "$OV/patches/$BASE/$d" || { echo "dry-run failed: $d"; exit 1; }; done
for d in "${DIFFS[@]}"; do apply < "$OV/patches/$BASE/$d"; done
(cd "$OV/files" && find . -type f -name '*.py') | while read -r f; do mkdir -p "$(dirname "$f")"; cp "$OV/files/$f" "$f"; done
python3 -m py_compile $( (cd "$OV/files" && find . -name '*.py'); for d in "${DIFFS[@]}"; do echo "${d%.diff}"; done )
echo "applied $SPEC to $ROOT (${#DIFFS[@]} patches)"
