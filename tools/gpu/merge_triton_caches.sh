#!/usr/bin/env bash
# Runs HERE (not on the GPU machine):  bash tools/gpu/merge_triton_caches.sh OUT.tar.xz CACHE.tar.{gz,xz}...
# Merges the Triton caches that GPU calls returned ($OUT/triton_cache.tar.gz) into one xz archive
# to carry as .gpu/triton_cache.tar.xz (ddtree_run.sh returns only what a run compiled, triton_new.tar.xz). Why: one call's cache is 11-15 MB gzipped, more than fits
# beside the 52.8 MB site under the 64 MiB carry; the calls' caches share most kernels, and xz's
# window folds the repeats, so four merged caches came to 2.1 MB (twelfth session's run 21).
set -eu
out=$1; shift
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
for c in "$@"; do tar -xf "$c" -C "$tmp"; done
tar -cf - -C "$tmp" triton | xz -9e > "$out"
echo "$out: $(ls "$tmp/triton" | wc -l) kernel groups, $(stat -c %s "$out") bytes"
