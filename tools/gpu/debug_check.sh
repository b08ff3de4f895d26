#!/usr/bin/env bash
# Runs ON THE GPU MACHINE from the repo root:  bash tools/gpu/debug_check.sh
# The smallest GPU check of the debug round: one copy-pair DDTREE server of overlay
# $DDTREE_VERSION (default 0.2.2) with --speculative-ddtree-debug (eager round, no overlap),
# two greedy requests, then a summary of its `ddtree_debug` lines (rounds, acceptance histogram,
# tree sizes and depths, draft top-1 agreement per depth). For a device budget of ~4 minutes.
set -u
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; G=.gpu
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export TVM_FFI_CACHE_DIR=/tmp/jitcache FLASHINFER_WORKSPACE_BASE=/tmp/fi TRITON_CACHE_DIR=/tmp/jitcache/triton
mkdir -p /tmp/site /tmp/jitcache && tar -xJf "$G/site.tar.xz" -C /tmp/site || exit 1
for f in "$G"/jitcache.tar.gz "$G"/triton_cache.tar.{xz,gz}; do [ -f "$f" ] && tar -xf "$f" -C /tmp/jitcache; done
cp -a /tmp/site /tmp/site_dd && bash tools/gpu/apply_overlay.sh "overlays/ddtree/${DDTREE_VERSION:-0.2.2}" /tmp/site_dd || exit 1
PYTHONPATH=/tmp/site python3 "$G/scripts/make_models.py" /tmp/models 2>&1 | grep -v shards
echo "[$(el)s] site, overlay and models ready"
PYTHONPATH=/tmp/site_dd setsid python3 -m sglang.launch_server --model-path /tmp/models/target_copy \
  --speculative-algorithm DDTREE --speculative-ddtree-budget 64 --speculative-draft-model-path /tmp/models/dflash_copy \
  --speculative-ddtree-debug --disable-cuda-graph --disable-overlap-schedule --host 127.0.0.1 --port 30000 \
  --attention-backend triton --sampling-backend pytorch --mem-fraction-static 0.04 --max-total-tokens 32768 \
  --context-length 2048 --random-seed 0 > "$OUT/server.log" 2>&1 &
PID=$!
python3 - <<'PY'
import json, time, urllib.request
def post(ids, n):
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}}
    req = urllib.request.Request("http://127.0.0.1:30000/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=60))["meta_info"]
deadline = time.time() + 150
while time.time() < deadline:
    try:
        urllib.request.urlopen("http://127.0.0.1:30000/health", timeout=2); break
    except Exception:
        time.sleep(2)
for ids in ([262, 263] * 4, [45] * 8):
    meta = post(ids, 48)
    print(ids[:2], {k: meta.get(k) for k in ("completion_tokens", "spec_accept_length", "spec_verify_ct")})
PY
kill -TERM -- -$PID 2>/dev/null; sleep 2; kill -KILL -- -$PID 2>/dev/null
grep -o 'ddtree_debug {.*}' "$OUT/server.log" | sed 's/^ddtree_debug //' > "$OUT/ddtree_debug.jsonl"
python3 - "$OUT/ddtree_debug.jsonl" <<'PY'
import collections, json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
print(f"{len(rows)} debug lines; first: {rows[0] if rows else None}")
for rid in dict.fromkeys(r["rid"] for r in rows):
    mine = [r for r in rows if r["rid"] == rid]
    agree = [[r["draft_top1_agree"][d] for r in mine if r["draft_top1_agree"][d] >= 0] for d in range(7)]
    print(rid[:8], "rounds", len(mine), "accept hist", dict(sorted(collections.Counter(r["accept_length"] for r in mine).items())),
          "nodes", sorted({r["tree_nodes"] for r in mine}), "depth", sorted({r["tree_depth"] for r in mine}),
          "top1 agreement per depth", [f"{sum(a)}/{len(a)}" for a in agree])
PY
echo "[$(el)s] done"; tail -n 5 "$OUT/server.log" | cut -c1-300
