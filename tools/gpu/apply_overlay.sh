#!/usr/bin/env bash
# Apply one overlay version to a package root by hand (what `ddtree-deploy push` does
# on a host), then byte-compile what it touched.
#   usage: apply_overlay.sh OVERLAY_VERSION_DIR PACKAGE_ROOT [BASE]
# Fails if a patch does not apply cleanly (patch -p1 --dry-run first).
set -euo pipefail
OV=$(cd "$1" && pwd); ROOT=$2; BASE=${3:-0.5.17}
cd "$ROOT"
# GNU patch if present, else git apply (same -p1 semantics, also outside a repository)
if command -v patch >/dev/null; then check() { patch -p1 --dry-run -s >/dev/null; }; apply() { patch -p1 -s --no-backup-if-mismatch; }
else check() { git apply -p1 --check; }; apply() { git apply -p1; }; fi
mapfile -t DIFFS < <(cd "$OV/patches/$BASE" && find . -name '*.diff' | sort)
for d in "${DIFFS[@]}"; do check < "$OV/patches/$BASE/$d" || { echo "dry-run failed: $d"; exit 1; }; done
for d in "${DIFFS[@]}"; do apply < "$OV/patches/$BASE/$d"; done
(cd "$OV/files" && find . -type f -name '*.py') | while read -r f; do mkdir -p "$(dirname "$f")"; cp "$OV/files/$f" "$f"; done
python3 -m py_compile $( (cd "$OV/files" && find . -name '*.py'); for d in "${DIFFS[@]}"; do echo "${d%.diff}"; done )
echo "applied $(basename "$(dirname "$OV")") $(basename "$OV") to $ROOT (${#DIFFS[@]} patches)"
