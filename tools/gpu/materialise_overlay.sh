#!/usr/bin/env bash
# Write a self-contained copy of an overlay version that inherits another: the parent's
# resolved folder, then the version's own files and patches on top, and the version's
# manifest without its `inherits:` line (for tools that do not resolve inheritance yet).
#   usage: tools/gpu/materialise_overlay.sh OVERLAY_DIR VERSION OUT_DIR
#   e.g.   tools/gpu/materialise_overlay.sh overlays/ddtree 0.3.0 /tmp/ov/ddtree   (-> /tmp/ov/ddtree/0.3.0)
set -euo pipefail
SRC=$(cd "$1" && pwd); V=$2; OUT=$3
resolve() {  # VERSION DEST: the parent chain first, each version's own folder on top
  local parent
  parent=$(sed -n 's/^inherits: *"\{0,1\}\([^"]*\)"\{0,1\} *$/\1/p' "$SRC/$1/overlay.yaml")
  [ -z "$parent" ] || resolve "$parent" "$2"
  mkdir -p "$2" && cp -r "$SRC/$1/." "$2/"
}
rm -rf "${OUT:?}/$V"; resolve "$V" "$OUT/$V"
sed -i '/^inherits:/d' "$OUT/$V/overlay.yaml"
echo "materialised $(basename "$SRC") $V into $OUT/$V"
