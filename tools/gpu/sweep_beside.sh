#!/usr/bin/env bash
# Runs ON THE GPU MACHINE from the repo root, in two calls that follow each other within the machine's
# idle release (30 s: a background job dies with the machine):
#   bash tools/gpu/sweep_beside.sh CASE...    # call 1: trains the pair, runs ddtree_run.sh CASES meanwhile,
#                                             # and starts bench_sweep.sh detached once the pair exists
#   bash tools/gpu/sweep_beside.sh --collect  # call 2: waits for the sweep, copies it to $OUT
# The trained-pair sweep (about 11 minutes after the training's 5) does not fit one call; the cases
# (correctness only: they share the GPU with the training) run while the pair trains. The sweep's
# restart and push overlap the cases' clients, its bench waits until they are done.
# Env: DDTREE_VERSION (the cases' and the sweep's overlay), SWEEP_BUDGETS (default 16,64,256,1024),
# SWEEP_TREE_STATS (default 0), CALL_S (call 1 returns after this many seconds, default 560, or when the
# sweep ends), COLLECT_S (call 2 waits at most this long, default 560). Carry .gpu/site.tar.xz, .gpu/scripts.
set -u
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
OUT=${OUT:-/tmp/out}; J=/tmp/sweepjob; M=/tmp/models/trained; R=$(pwd)
mkdir -p "$OUT"
running() { [ -f $J/pid ] && kill -0 "$(cat $J/pid)" 2>/dev/null; }
report() {  # what the sweep has so far, into $OUT (at most 8 files come back)
  cp $J/train.txt "$OUT/train.txt" 2>/dev/null; cp $J/log "$OUT/sweep_log.txt" 2>/dev/null
  [ -d $J/out ] && tar -czf "$OUT/sweep.tar.gz" -C $J/out --exclude=jitcache.tar.gz . 2>/dev/null
  cp $J/out/sweep/bench.md "$OUT/bench.md" 2>/dev/null; true
}
wait_sweep() {  # seconds
  while running && [ "$(el)" -lt "$1" ]; do sleep 10; report; done
  report; echo "[$(el)s] sweep $(running && echo 'still running' || echo 'ended'); $(tail -n 3 $J/log 2>/dev/null)"
}

if [ "${1:-}" = --collect ]; then
  [ -d $J ] || { echo "no sweep on this machine (it is a fresh one: the first call's job died with the last)"; exit 3; }
  wait_sweep "${COLLECT_S:-560}"; exit 0
fi

: "${DDTREE_VERSION:?set DDTREE_VERSION: the cases' and the sweep's overlay}"
running && { echo "a sweep is already running on this machine (pid $(cat $J/pid)); collect it with --collect"; exit 3; }
rm -rf "$J"; mkdir -p "$J/out"  # a warm machine's earlier markers would start or end this sweep early
if [ ! -f /tmp/site/.done ]; then mkdir -p /tmp/site && tar -xJf .gpu/site.tar.xz -C /tmp/site && touch /tmp/site/.done || exit 1; fi
# The training leaves one marker, trained or train_failed, so the waiter below never sits out its
# 900 s on a training that already died.
setsid nohup bash -c 'PYTHONPATH="$1:/tmp/site" python3 tools/gpu/train_tiny_pair.py --out "$2" --seed "$3" \
  > "$4/train.txt" 2>&1 && touch "$4/trained" || touch "$4/train_failed"' _ "$R" "$M" "${SEED:-0}" "$J" > /dev/null 2>&1 &
# the sweep starts once the pair exists (bench_sweep.sh would otherwise train it a second time)
setsid nohup bash -c 'J=$1; w=0
  while [ ! -e "$J/trained" ] && [ ! -e "$J/train_failed" ] && [ $w -lt 900 ]; do sleep 3; w=$((w + 3)); done
  [ -e "$J/trained" ] || { echo "no trained pair: see train.txt"; exit 1; }
  OUT=$J/out PORT=31000 SITE=/tmp/site_sweep WAIT_BENCH=$J/cases_done BUDGETS=$2 TREE_STATS=$3 \
    bash tools/gpu/bench_sweep.sh' _ "$J" "${SWEEP_BUDGETS:-16,64,256,1024}" "${SWEEP_TREE_STATS:-0}" > "$J/log" 2>&1 &
echo $! > "$J/pid"
echo "[$(el)s] training and the sweep started; cases: $*"
if [ $# -gt 0 ]; then  # its many files stay here; only its packed results come back
  OUT=$J/cases PYTHONPATH=/tmp/site bash tools/gpu/ddtree_run.sh "$@"
  cp $J/cases/results.tar.gz "$OUT/cases.tar.gz"; grep -h -E "STRESS|MATCH|tok/s|accept" $J/cases/w/compare.txt | head -n 60
fi
touch $J/cases_done
echo "[$(el)s] cases done"
wait_sweep "${CALL_S:-560}"
