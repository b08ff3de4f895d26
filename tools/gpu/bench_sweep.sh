#!/usr/bin/env bash
# Runs ON THE GPU MACHINE from the repo root:  bash tools/gpu/bench_sweep.sh
# The budget sweep on the trained tiny pair, by the tool itself: trains the pair once
# (tools/gpu/train_tiny_pair.py, seeded; /tmp/models/trained is reused), starts the real SGLang 0.5.17
# (/tmp/site) on it as a `transport: local` host, pushes ddtree $DDTREE_VERSION (default 0.2.2), then
# `ddtree-deploy bench` (plain, DFLASH, DDTREE at $BUDGETS), which writes bench.json, bench.md and the
# plots to $OUT/sweep. A server start takes 60-120 s, so one command fits about four variants: split
# the sweep with BUDGETS (e.g. BUDGETS=16,64 then BUDGETS=256,1024 with DFLASH=0) and TREE_STATS=0,
# and merge nothing by hand: each run's folder is complete, and --baseline compares them.
# Carry: .gpu/site.tar.xz (and .gpu/jitcache.tar.gz if any). Everything lands in $OUT.
# Beside ddtree_run.sh in the background: SITE (default /tmp/site) is the host's package root (give
# it its own copy: the push patches it), PORT (default 30000), WAIT_RESTART=FILE / WAIT_BENCH=FILE
# hold the first restart and the bench until FILE exists (at most 900 s each), so the sweep's
# timed passes do not share the GPU with the other job's clients; KEEP_GOING=1 (default) passes
# --keep-going (a variant that is not lossless does not end the sweep); PROMPTS=default runs the bench's
# pinned prompts instead of the pair's held-out corpus windows; SEEDS (e.g. '0') the sampled passes.
set -u -o pipefail
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; R=$(pwd); G=$R/.gpu; V=${DDTREE_VERSION:-0.2.2}
BUDGETS=${BUDGETS:-16,32,64,128,256,512,1024}; BATCH=${BATCH:-4}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export TVM_FFI_CACHE_DIR=/tmp/jitcache FLASHINFER_WORKSPACE_BASE=/tmp/fi TRITON_CACHE_DIR=/tmp/jitcache/triton
if [ ! -f /tmp/site/.done ]; then mkdir -p /tmp/site && tar -xJf "$G/site.tar.xz" -C /tmp/site && touch /tmp/site/.done || { echo "unpack failed"; exit 1; }; fi
mkdir -p /tmp/jitcache; [ -f "$G/jitcache.tar.gz" ] && tar -xzf "$G/jitcache.tar.gz" -C /tmp/jitcache
SITE=${SITE:-/tmp/site}
if [ ! -f "$SITE/.done" ]; then rm -rf "$SITE" && cp -a /tmp/site "$SITE" || exit 1; fi
hold() { local w0; w0=$(el); [ -z "$1" ] && return; while [ ! -e "$1" ] && [ $(( $(el) - w0 )) -lt 900 ]; do sleep 3; done; echo "[$(el)s] held for $1: $(( $(el) - w0 )) s"; }
M=/tmp/models/trained
if [ ! -f "$M/train_log.json" ]; then
  PYTHONPATH=$R:/tmp/site python3 tools/gpu/train_tiny_pair.py --out "$M" --seed "${SEED:-0}" 2>&1 | tail -n 25 || exit 1
fi
cp "$M/train_log.json" "$OUT/" && echo "[$(el)s] pair ready, offline chain acceptance: $(python3 -c "import json; d = json.load(open('$M/train_log.json')); print(d['chain_acceptance_offline'], 'corpus,', d.get('chain_acceptance_bench_prompts'), 'on the bench prompts')")"

. tools/gpu/local_host.sh
local_host_inventory "$OUT/inventory.yaml" "$M/target" "$M/dflash_draft" 0.2 65536 "$BATCH" "$SITE" "${PORT:-30000}"
tool() {  # timeout args...
  local t=$1; shift
  echo "[$(el)s] \$ ddtree-deploy $*" | tee -a "$OUT/transcript.txt"
  PYTHONPATH=$R:/tmp/site DDTREE_INVENTORY=$OUT/inventory.yaml \
    timeout "$t" python3 -m ddtree_deploy.cli "$@" 2>&1 | tee -a "$OUT/transcript.txt"
  echo "[$(el)s] exit ${PIPESTATUS[0]}" | tee -a "$OUT/transcript.txt"
}
hold "${WAIT_RESTART:-}"
tool 240 restart --host h200
tool 300 push --host h200 --overlay "ddtree@$V"
EXTRA=(); [ "${DFLASH:-1}" = 1 ] || EXTRA+=(--no-dflash); [ "${TREE_STATS:-1}" = 1 ] || EXTRA+=(--no-tree-stats)
[ -n "${BASELINE:-}" ] && EXTRA+=(--baseline "$BASELINE"); [ "${KEEP_GOING:-1}" = 1 ] && EXTRA+=(--keep-going)
# The held-out corpus prompts (PROMPTS=default for the bench's pinned prose), and the trainer's offline
# DFLASH rounds on the same prompts: greedy commits the same tokens, so the server's DFLASH must match
# them request by request (the bench lists the prompts that differ).
OFFLINE=$M/dflash_offline_bench_prompts.json
if [ "${PROMPTS:-corpus}" = corpus ]; then  # never a silent fall-back to the pinned prompts
  [ -f "$M/corpus_prompts.json" ] || { echo "$M/corpus_prompts.json is missing: retrain the pair, or PROMPTS=default"; exit 2; }
  EXTRA+=(--prompts "$M/corpus_prompts.json"); OFFLINE=$M/dflash_offline_corpus.json
fi
[ -n "${SEEDS:-}" ] && EXTRA+=(--seeds "$SEEDS")
[ "${DFLASH:-1}" = 1 ] && [ -f "$OFFLINE" ] && EXTRA+=(--baseline "$OFFLINE=dflash")
hold "${WAIT_BENCH:-}"
tool "${BENCH_TIMEOUT:-3000}" bench --host h200 --budgets "$BUDGETS" --batch "$BATCH" --results "$OUT/sweep" "${EXTRA[@]}"
[ -d /tmp/jitcache ] && tar -czf "$OUT/jitcache.tar.gz" -C /tmp/jitcache . 2>/dev/null
echo "[$(el)s] done; $(ls "$OUT/sweep" 2>/dev/null | tr '\n' ' ')"
