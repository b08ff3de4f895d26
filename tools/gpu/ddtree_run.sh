#!/usr/bin/env bash
# Runs ON THE GPU MACHINE from the repo root:  bash tools/gpu/ddtree_run.sh CASE [CASE...]
# Needs .gpu/site.tar.xz and .gpu/scripts (GPU.md recipe) carried along; optional .gpu/jitcache.tar.gz.
# Pristine SGLang 0.5.17 goes to /tmp/site, a copy with overlay ddtree $DDTREE_VERSION (default
# 0.2.2) applied to /tmp/site_dd. All servers start in parallel (one port each), then each client runs alone
# (timings are not shared) and is compared with the plain case of its pair at once; before the
# copy pair's clients, the other pair's servers are stopped, so speed runs share the machine with
# idle copy-pair servers only. Refusal cases (hybrid target, budget out of range) must exit with
# their error. TREE_BENCH=1 also runs bench/tree_build.py --device cuda on cores the servers
# do not use (servers: cores 0-11; bench: 12-15), while the servers start.
# Attention backend: triton, or fa3 / flashinfer for a case named with the suffix _fa3 / _fi (e.g.
# copy_plain_fa3 copy_ddtree64_fa3); such a case is compared with the plain case of the same backend.
# A case suffixed _auto passes no --attention-backend (the server's own choice) and is compared with
# the triton plain case. refuse_fa3 is a DDTREE server asked for fa3 (0.2.2 must refuse it).
# Hybrid (GatedDeltaNet) cases hyb_rand_*, hyb_allexp_*, hyb_copy_* and hyb_induct_* run on make_hybrid.py's targets
# (hyb_induct: make_induction_hybrid.py's, whose next token depends on the recurrent state; its
# client sends hybrid_client.py's INDUCT prompts only) with
# --max-running-requests 8, are compared with their pair's plain case, and are driven by
# hybrid_client.py; a case whose name ends in _dbg runs eager with --speculative-ddtree-debug and
# gets its ddtree_debug lines summarised (hybrid_debug_summary.py); *_fault cases run on
# /tmp/site_fault, the overlay without its memory_pool.py patch (the planted fault: the
# deduplicated conv-window layout left on). HYB_CLIENT_MODE=greedy runs only the greedy prompts (the
# default for _dbg cases). ROUTER_TIES=1: after the clients, router_ties.py reads hyb_rand_plain.json against
# hyb_rand_dflash.json and hyb_rand_ddtree64.json (those present) and prints the MoE router's
# k/k+1 logit gaps at each split beside their non-split distribution (issue 16), to compare.txt;
# its JSON goes to CASE.router_ties.json. A carried .gpu/triton_cache.tar.xz or .tar.gz (from earlier runs; merge_triton_caches.sh) skips compiles;
# $OUT/triton_new.tar.xz holds what this run compiled.
# A case suffixed _prev (copy_ddtree16_prev, copy_ddtree64_prev, hyb_*_ddtree{16,64}_prev) runs on /tmp/site_prev, overlay ddtree
# $DDTREE_PREV (default 0.2.2) applied: two overlay versions side by side in one run.
# A case suffixed _tprof (copy_dflash, copy_ddtree64, hyb_copy_dflash, hyb_copy_ddtree16, hyb_copy_ddtree64)
# gets no client: torch_profile.py profiles 40 of its scheduler's steps on repeating prompts at batch 1
# (SGLang's /start_profile) and prints the kernels and CPU ops per step; the trace comes back as
# $OUT/tprof_CASE.tar.gz. Run the DFLASH and DDTREE ones in the same call.
# copy_ddtree16_prof / copy_ddtree64_prof run with SGLANG_DDTREE_PROFILE=1 (0.3.0-rc.4 and later): their
# ddtree_profile lines (per-stage GPU and host ms of the round) are summarised by profile_summary.py.
# Stress cases copy_stress_{plain,dflash,ddtree64,ddtree256,ddtree64_prev,dflash_check,ddtree64_check} run the copy pair with
# --max-running-requests 4 (a finished request's row is the next one handed out) under
# stress_client.py: staggered arrivals, max_new_tokens and stop strings/ids; list copy_stress_plain
# first (its plan and outputs are the reference), the others must match it and bring the allocator's
# used-token count back after the drain; _check adds SGLang's per-iteration pool and KV page checks
# (duplicate free pages, freed pages still owned; dflash_check is their control) and _prev is
# $DDTREE_PREV (0.3.0-rc.3: its commit rewrote req_to_token). Lines STRESS*[case] go to compare.txt, with any leak/double-free log lines.
# Sharing the machine with another job (bench_sweep.sh in the background): PORT_BASE (default 30000)
# and NCCL_PORT_BASE (28000) move the ports, CLIENTS_AFTER=FILE holds the clients until FILE exists
# (at most CLIENTS_WAIT s, default 600), and $OUT/w/done.CASE is touched after each case's client,
# done.all at the end.
# GRAMMAR_CLIENT=1: the dense copy pair's cases (copy_plain, copy_dflash, copy_ddtree*) are driven by
# hybrid_client.py too, so their regex-constrained requests are compared with plain's (HYBRID[...] lines).
# Each server's NCCL port is pinned: NCCL_PORT_BASE (default 28000) + its index, a range of its own below
# the ephemeral ports (32768 on) and apart from the HTTP ports (PORT_BASE, and bench_sweep.sh's 31000). Left
# to SGLang's get_free_port, a port probed free can be taken before the server binds it, likely what
# happened in run 34 call 2 (EADDRINUSE at init_process_group while four servers started).
# Every server runs with --sleep-on-idle: an idle scheduler otherwise spins a core, and the idle
# servers share cores 0-11 with the one being timed.
set -u
CASES=("$@")
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
extras() { [[ $1 = hyb_* ]] || { [ "${GRAMMAR_CLIENT:-0}" = 1 ] && [[ $1 = copy_* && $1 != copy_stress_* ]]; }; }  # hybrid_client.py
OUT=${OUT:-/tmp/out}; O=$OUT/w; mkdir -p "$O"; R=$(pwd); G=$R/.gpu
pack() { (cd "$O" && tar -czf "$OUT/results.tar.gz" .); }   # after every stage: a timeout loses nothing
trap pack EXIT
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export TVM_FFI_CACHE_DIR=/tmp/jitcache FLASHINFER_WORKSPACE_BASE=/tmp/fi TRITON_CACHE_DIR=/tmp/jitcache/triton
BUDGET=${BUDGET:-570}
if [ ! -f /tmp/site/.done ]; then mkdir -p /tmp/site && tar -xJf "$G/site.tar.xz" -C /tmp/site && touch /tmp/site/.done || { echo "unpack failed"; exit 1; }; fi
if [ -f "$G/jitcache.tar.gz" ] && [ ! -d /tmp/jitcache ]; then mkdir -p /tmp/jitcache && tar -xzf "$G/jitcache.tar.gz" -C /tmp/jitcache; fi
for f in "$G"/triton_cache.tar.{xz,gz}; do [ -f "$f" ] && [ ! -d /tmp/jitcache/triton ] && mkdir -p /tmp/jitcache && tar -xf "$f" -C /tmp/jitcache; done
mkdir -p /tmp/jitcache/triton; ls /tmp/jitcache/triton > /tmp/triton_carried  # what comes back is only what this run compiled
V=overlays/ddtree/${DDTREE_VERSION:-0.2.2}
if [ ! -f /tmp/site_dd/.done ]; then rm -rf /tmp/site_dd && cp -a /tmp/site /tmp/site_dd && bash tools/gpu/apply_overlay.sh "$V" /tmp/site_dd && touch /tmp/site_dd/.done || { echo "overlay apply failed"; exit 1; }; fi
if [[ " ${CASES[*]} " == *_fault\ * ]] && [ ! -f /tmp/site_fault/.done ]; then rm -rf /tmp/site_fault && cp -a /tmp/site /tmp/site_fault && SKIP_PATCHES=sglang/srt/mem_cache/memory_pool.py.diff bash tools/gpu/apply_overlay.sh "$V" /tmp/site_fault && touch /tmp/site_fault/.done || { echo "fault overlay apply failed"; exit 1; }; fi
if [[ " ${CASES[*]} " == *_prev\ * ]] && [ ! -f /tmp/site_prev/.done ]; then rm -rf /tmp/site_prev && cp -a /tmp/site /tmp/site_prev && bash tools/gpu/apply_overlay.sh "overlays/ddtree/${DDTREE_PREV:-0.2.2}" /tmp/site_prev && touch /tmp/site_prev/.done || { echo "previous overlay apply failed"; exit 1; }; fi
echo "[$(el)s] sites ready"
[ -d /tmp/models/target_copy ] || PYTHONPATH=/tmp/site python3 "$G/scripts/make_models.py" /tmp/models 2>&1 | grep -v shards
[ -d /tmp/models/hybrid ] || PYTHONPATH=/tmp/site python3 -c "
from transformers import Qwen3NextConfig; import shutil
Qwen3NextConfig(num_hidden_layers=4, hidden_size=256, vocab_size=1024, architectures=['Qwen3NextForCausalLM']).save_pretrained('/tmp/models/hybrid')
[shutil.copy('/tmp/models/target/'+f, '/tmp/models/hybrid/') for f in ('tokenizer.json','tokenizer_config.json')]"
[[ " ${CASES[*]} " != *\ hyb_* ]] || [ -d /tmp/models/hyb_copy ] || PYTHONPATH=/tmp/site python3 "$G/scripts/make_hybrid.py" /tmp/models 2>&1 | grep -v shards
[[ " ${CASES[*]} " != *\ hyb_induct_* ]] || [ -d /tmp/models/hyb_induct ] || PYTHONPATH=/tmp/site python3 tools/gpu/make_induction_hybrid.py /tmp/models 2>&1 | grep -v shards
echo "[$(el)s] models ready"

M=/tmp/models; DD="--speculative-algorithm DDTREE --speculative-ddtree-budget"
declare -A CASE=(
  [copy_plain]="--model-path $M/target_copy"
  [copy_plain_draftarg]="--model-path $M/target_copy --speculative-draft-model-path $M/dflash_copy"
  [copy_dflash]="--model-path $M/target_copy --speculative-algorithm DFLASH --speculative-draft-model-path $M/dflash_copy"
  [copy_ddtree16]="--model-path $M/target_copy $DD 16 --speculative-draft-model-path $M/dflash_copy"
  [copy_ddtree64]="--model-path $M/target_copy $DD 64 --speculative-draft-model-path $M/dflash_copy"
  [copy_ddtree64_safe]="--model-path $M/target_copy $DD 64 --speculative-draft-model-path $M/dflash_copy --speculative-ddtree-debug --disable-cuda-graph --disable-overlap-schedule"
  [copy_ddtree16_prev]="--model-path $M/target_copy $DD 16 --speculative-draft-model-path $M/dflash_copy"
  [copy_ddtree64_prev]="--model-path $M/target_copy $DD 64 --speculative-draft-model-path $M/dflash_copy"
  [copy_ddtree256]="--model-path $M/target_copy $DD 256 --speculative-draft-model-path $M/dflash_copy"
  [plain]="--model-path $M/target"
  [dflash]="--model-path $M/target --speculative-algorithm DFLASH --speculative-draft-model-path $M/dflash_draft"
  [ddtree64]="--model-path $M/target $DD 64 --speculative-draft-model-path $M/dflash_draft --speculative-ddtree-debug"
  [refuse_hybrid]="--model-path $M/hybrid $DD 64 --speculative-draft-model-path $M/dflash_copy"
  [refuse]="--model-path $M/target_copy $DD 64 --speculative-draft-model-path $M/dflash_copy"
  [refuse_budget]="--model-path $M/target_copy $DD 3 --speculative-draft-model-path $M/dflash_copy"
)
HYB="--max-running-requests 8"; DBG="--speculative-ddtree-debug --disable-cuda-graph"
for t in rand allexp copy induct; do
  d=$M/dflash_draft; case $t in copy|induct) d=$M/dflash_copy;; esac
  CASE[hyb_${t}_plain]="--model-path $M/hyb_$t $HYB"
  CASE[hyb_${t}_dflash]="--model-path $M/hyb_$t $HYB --speculative-algorithm DFLASH --speculative-draft-model-path $d"
  for b in 16 64; do
    CASE[hyb_${t}_ddtree$b]="--model-path $M/hyb_$t $HYB $DD $b --speculative-draft-model-path $d"
    CASE[hyb_${t}_ddtree${b}_prev]="${CASE[hyb_${t}_ddtree$b]}"
  done
  CASE[hyb_${t}_ddtree64_dbg]="--model-path $M/hyb_$t $HYB $DD 64 --speculative-draft-model-path $d $DBG"
  CASE[hyb_${t}_ddtree64_dbg_fault]="${CASE[hyb_${t}_ddtree64_dbg]}"
done
# Hybrid refusals: no --max-running-requests; the lazy track strategy; an interval below the
# block size (8); per-node states larger than a tiny static pool.
HR="--model-path $M/hyb_copy --speculative-draft-model-path $M/dflash_copy $DD 64"
CASE[refuse_hyb_maxreq]="$HR"
CASE[refuse_hyb_lazy]="$HR $HYB --mamba-radix-cache-strategy extra_buffer_lazy"
CASE[refuse_hyb_track]="$HR $HYB --mamba-track-interval 4"
CASE[refuse_hyb_memory]="$HR $HYB"
declare -A EXTRA=([refuse_hyb_memory]="--mem-fraction-static 0.0004")  # after COMMON, so it wins
S="--model-path $M/target_copy --max-running-requests 4"
CASE[copy_stress_plain]="$S"
CASE[copy_stress_dflash]="$S --speculative-algorithm DFLASH --speculative-draft-model-path $M/dflash_copy"
CASE[copy_stress_dflash_check]="${CASE[copy_stress_dflash]}"
for c in copy_stress_ddtree64 copy_stress_ddtree64_check copy_stress_ddtree64_prev; do
  CASE[$c]="$S $DD 64 --speculative-draft-model-path $M/dflash_copy"
done
CASE[copy_stress_ddtree256]="$S $DD 256 --speculative-draft-model-path $M/dflash_copy"  # rc.27+: a frontier in two phases
MEMCHECK="SGLANG_CHECK_KV_PAGE_INVARIANTS=1 SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY=1"
declare -A CENV=([copy_stress_dflash_check]="$MEMCHECK" [copy_stress_ddtree64_check]="$MEMCHECK")
for c in copy_dflash copy_ddtree64 hyb_copy_dflash hyb_copy_ddtree16 hyb_copy_ddtree64; do  # torch profiler only
  CASE[${c}_tprof]="${CASE[$c]}"
done
# Sampling cases samp_{plain,dflash,ddtree16,ddtree16_prev} (--sampling-backend pytorch) on the random pair: sample_client.py draws
# continuations at T 3 under top_k 3 with and without top_p 0.55, sample_compare.py tests each
# case's per-position rank distribution against samp_plain's (chi-square; ranks from samp_plain).
RP="--model-path $M/target --speculative-draft-model-path $M/dflash_draft"
CASE[samp_plain]="--model-path $M/target"
CASE[samp_dflash]="$RP --speculative-algorithm DFLASH"
CASE[samp_ddtree16]="$RP $DD 16"; CASE[samp_ddtree16_prev]="$RP $DD 16"
# samp_fi_{plain,dflash,ddtree16}: the same on --sampling-backend flashinfer (SGLang's default on CUDA),
# compared with samp_fi_plain.
for c in plain dflash ddtree16; do CASE[samp_fi_$c]="${CASE[samp_$c]}"; EXTRA[samp_fi_$c]="--sampling-backend flashinfer"; done
for b in 16 64; do  # the round's stage times (0.3.0-rc.4+): ddtree_profile lines, summarised after the client
  CASE[copy_ddtree${b}_prof]="${CASE[copy_ddtree$b]}"; CENV[copy_ddtree${b}_prof]="SGLANG_DDTREE_PROFILE=1 SGLANG_DDTREE_PROFILE_EVERY=32"
done
COMMON="--host 127.0.0.1 --sampling-backend pytorch --mem-fraction-static 0.04 --max-total-tokens 32768 --context-length 2048 --cuda-graph-max-bs-decode 4 --disable-prefill-cuda-graph --random-seed 0 --log-level info --sleep-on-idle"
suffix_of() { case $1 in *_fa3) echo _fa3;; *_fi) echo _fi;; *_auto) echo _auto;; esac; }
backend_of() { case $(suffix_of "$1") in _fa3) echo fa3;; _fi) echo flashinfer;; _auto) ;; *) echo triton;; esac; }
declare -A PORT NCCL_PORT PID
i=0
for c in "${CASES[@]}"; do
  PORT[$c]=$((${PORT_BASE:-30000} + i)); NCCL_PORT[$c]=$((${NCCL_PORT_BASE:-28000} + i)); i=$((i + 1))
  site=/tmp/site; case $c in *_fault) site=/tmp/site_fault;; *_prev) site=/tmp/site_prev;; *ddtree*|refuse_*) site=/tmp/site_dd;; esac
  # shellcheck disable=SC2086
  base=${c%$(suffix_of "$c")}
  be=$(backend_of "$c")
  env ${CENV[$c]:-} PYTHONPATH=$site setsid taskset -c 0-11 python3 -m sglang.launch_server ${CASE[$base]} $COMMON ${be:+--attention-backend $be} --port ${PORT[$c]} --nccl-port ${NCCL_PORT[$c]} ${EXTRA[$c]:-} > "$O/$c.log" 2>&1 &
  PID[$c]=$!
done
if [ "${TREE_BENCH:-0}" = 1 ]; then
  (timeout 200 taskset -c 12-15 python3 bench/tree_build.py --device cuda > "$O/tree_build.txt" 2>&1; echo "exit $?" >> "$O/tree_build.txt") &
fi
up() { python3 -c "import sys,urllib.request; urllib.request.urlopen(f\"http://127.0.0.1:{sys.argv[1]}/health_generate\", timeout=5)" "$1" >/dev/null 2>&1; }
declare -A READY
while [ $(el) -lt $((BUDGET - 200)) ]; do
  pending=0
  for c in "${CASES[@]}"; do
    [ -n "${READY[$c]:-}" ] && continue
    if ! kill -0 ${PID[$c]} 2>/dev/null; then READY[$c]=exited; echo "[$(el)s] $c: exited"; continue; fi
    if up ${PORT[$c]}; then READY[$c]=yes; echo "[$(el)s] $c: READY"; else pending=1; fi
  done
  [ $pending = 0 ] && break; sleep 3
done
if [ -n "${CLIENTS_AFTER:-}" ]; then
  w0=$(el); while [ ! -e "$CLIENTS_AFTER" ] && [ $(( $(el) - w0 )) -lt "${CLIENTS_WAIT:-600}" ]; do sleep 3; done
  echo "[$(el)s] clients start ($CLIENTS_AFTER $([ -e "$CLIENTS_AFTER" ] && echo exists || echo 'still missing'))"
fi
ref_of() { local s; s=$(suffix_of "$1"); [ "$s" = _auto ] && s=; case $1 in hyb_rand_*) echo hyb_rand_plain;; hyb_allexp_*) echo hyb_allexp_plain;; hyb_copy_*) echo hyb_copy_plain;; hyb_induct_*) echo hyb_induct_plain;; copy_stress_*) echo copy_stress_plain;; samp_fi_*) echo samp_fi_plain;; samp_*) echo samp_plain;; copy_*) echo "copy_plain$s";; *) echo "plain$s";; esac; }
stop_case() { kill -TERM -- -${PID[$1]} 2>/dev/null; sleep 2; kill -KILL -- -${PID[$1]} 2>/dev/null; }
stress_case() {  # stress_client.py against the plain stress run's plan and outputs (none: plans itself)
  local ref=copy_stress_plain refjson=
  [ "$1" != $ref ] && [ -f "$O/$ref.json" ] && refjson="$O/$ref.json"
  if [ "${READY[$1]:-}" != yes ]; then echo "[$(el)s] $1: NOT ready; log tail:"; grep -v "^\[20" "$O/$1.log" | tail -n 25 | cut -c1-300; return; fi
  echo "[$(el)s] $1: stress client"
  PYTHONPATH=/tmp/site timeout 240 python3 tools/gpu/stress_client.py ${PORT[$1]} "$O/$1.json" "$1" $refjson > "$O/$1.stress.txt" 2>&1 || echo "STRESS_CLIENT[$1] FAILED (exit $?)" >> "$O/$1.stress.txt"
  grep -h -E "leak detected|double free|use-after-free|Mem Leak|Traceback" "$O/$1.log" | head -n 5 | sed "s/^/  log[$1]: /" >> "$O/$1.stress.txt"
  tail -n 60 "$O/$1.stress.txt" | tee -a "$O/compare.txt"
}
for c in "${CASES[@]}"; do
  case $c in refuse_*) echo "[$(el)s] $c: ${READY[$c]:-running}; error line:"; grep -h -E "DDTREE|must be in|Error" "$O/$c.log" | tail -n 3 | cut -c1-500; continue;; esac
  case $c in copy_stress_*) stress_case "$c"; touch "$O/done.$c"; pack; continue;; esac
  # SKIP_CLIENTS=1: the servers serve only the group tools below (a speed call, no client's T = 0.8 compile stall)
  if [ "${SKIP_CLIENTS:-0}" = 1 ]; then echo "[$(el)s] $c: ${READY[$c]:-not ready}, client skipped"; touch "$O/done.$c"; continue; fi
  if [[ $(ref_of "$c") = copy_plain* ]] && [ -z "${STOPPED:-}" ]; then  # the other pair is done: stop its servers
    for d in "${CASES[@]}"; do [[ $(ref_of "$d") = plain* ]] && kill -0 ${PID[$d]} 2>/dev/null && stop_case "$d"; done; STOPPED=1
  fi
  if [ "${READY[$c]:-}" = yes ] && [[ $c = *_tprof ]]; then
    echo "[$(el)s] $c: torch profiler"
    PYTHONPATH=/tmp/site timeout 300 python3 tools/gpu/torch_profile.py run ${PORT[$c]} "$O/tprof_$c" "$c" > "$O/$c.tprof.txt" 2>&1 \
      || echo "TPROF[$c] FAILED (exit $?)" >> "$O/$c.tprof.txt"
    tee -a "$O/compare.txt" < "$O/$c.tprof.txt"
    tar -czf "$OUT/tprof_$c.tar.gz" -C "$O" "tprof_$c" 2>/dev/null; rm -rf "${O:?}/tprof_$c"; pack
  elif [ "${READY[$c]:-}" = yes ]; then
    client=tools/gpu/ddtree_client.py; extras $c && client=tools/gpu/hybrid_client.py; [[ $c = samp_* ]] && client=tools/gpu/sample_client.py
    ct=150; [[ $c = samp_* ]] && ct=290  # the DFLASH-rule cases' first sample compiles flashinfer's sampling (~104 s)
    echo "[$(el)s] $c: client"; PYTHONPATH=/tmp/site timeout $ct python3 $client ${PORT[$c]} "$O/$c.json" $(case $c in hyb_induct_*) echo induct;; *_dbg*) echo "${HYB_CLIENT_MODE:-greedy}";; *) echo "${HYB_CLIENT_MODE:-}";; esac) || echo "[$(el)s] $c: client FAILED"; pack
    case $c in *_dbg*) python3 tools/gpu/hybrid_debug_summary.py "$c" "$O/$c.log" | tee -a "$O/compare.txt";; esac
    case $c in *_prof) python3 tools/gpu/profile_summary.py "$c" "$O/$c.log" | tee -a "$O/compare.txt";; esac
  else
    echo "[$(el)s] $c: NOT ready; log tail:"; grep -v "^\[20" "$O/$c.log" | tail -n 25 | cut -c1-300
  fi
  ref=$(ref_of "$c"); touch "$O/done.$c"
  [ "$c" = "$ref" ] || [ ! -f "$O/$c.json" ] || [ ! -f "$O/$ref.json" ] && continue
  if [[ $c = samp_* ]]; then
    PYTHONPATH=/tmp/site timeout 120 python3 tools/gpu/sample_compare.py "$O/$ref.json" "$O/$c.json" "$c" ${PORT[$ref]} | tee -a "$O/compare.txt"; pack; continue
  fi
  PYTHONPATH=/tmp/site timeout 60 python3 tools/gpu/ddtree_compare.py "$O/$ref.json" "$O/$c.json" "$ref vs $c" ${PORT[$ref]} | tee -a "$O/compare.txt"
  if extras $c; then python3 tools/gpu/hybrid_compare.py "$O/$ref.json" "$O/$c.json" "$ref vs $c" | tee -a "$O/compare.txt"; fi; pack
done
if [ "${ROUTER_TIES:-0}" = 1 ] && [ -f "$O/hyb_rand_plain.json" ]; then
  for c in hyb_rand_dflash hyb_rand_ddtree64; do
    [ -f "$O/$c.json" ] || continue
    echo "[$(el)s] router ties: hyb_rand_plain vs $c"
    PYTHONPATH=/tmp/site timeout 300 python3 tools/gpu/router_ties.py $M/hyb_rand "$O/hyb_rand_plain.json" "$O/$c.json" \
      --label "hyb_rand_plain vs $c" --out "$O/$c.router_ties.json" 2>&1 | grep -v -E "falling back|Loading weights" | tee -a "$O/compare.txt"; pack
  done
fi
# Client tools over ';'-separated groups of ready servers, each group's first case the baseline:
# SPEED_CASES="a b c; d e": interleaved speed medians (speed_interleave.py, SPEED_REPEATS each, default 5;
# SPEED_CONTEXTS=0,1000,1700 adds each prompt class stretched to those context lengths);
# GRAMMAR_MIX_CASES="a b; c d": grammar_mix.py (GRAMMAR_MIX_REPEATS each, default 5), what one regex request
# costs the three requests batched beside it (it is aborted when they finish: /abort_request).
# Both under SPEED_TIMEOUT (default 240 s). Output: $O/speedN.json and $O/grammar_mixN.json.
over_groups() {  # LABEL TOOL OUT_STEM REPEATS MIN_SERVERS GROUPS
  local g=0 group c; local -a groups args; IFS=';' read -ra groups <<< "$6"
  for group in "${groups[@]}"; do
    args=(); for c in $group; do [ "${READY[$c]:-}" = yes ] && args+=("$c=${PORT[$c]}"); done
    [ ${#args[@]} -ge "$5" ] || continue; g=$((g + 1))
    echo "[$(el)s] $1: ${args[*]}"
    PYTHONPATH=/tmp/site timeout "${SPEED_TIMEOUT:-240}" python3 "tools/gpu/$2.py" "$O/$3$g.json" "$4" "${args[@]}" 2>&1 | tee -a "$O/compare.txt"; pack
  done
}
over_groups "interleaved speed" speed_interleave speed "${SPEED_REPEATS:-5}" 2 "${SPEED_CASES:-}"
over_groups "grammar mix" grammar_mix grammar_mix "${GRAMMAR_MIX_REPEATS:-5}" 1 "${GRAMMAR_MIX_CASES:-}"
for c in "${CASES[@]}"; do kill -TERM -- -${PID[$c]} 2>/dev/null; done; sleep 3
for c in "${CASES[@]}"; do kill -KILL -- -${PID[$c]} 2>/dev/null; done
touch "$O/done.all"; wait; grep -h "ddtree_debug" "$O"/*.log | head -2000 > "$O/ddtree_debug.txt"
[ -d /tmp/jitcache ] && tar -czf "$OUT/jitcache.tar.gz" --exclude=./triton -C /tmp/jitcache . 2>/dev/null
# Only the kernel groups this run compiled, in xz (a whole cache in gzip passed the 16 MiB a file
# may take back); merge_triton_caches.sh folds them into the carried .gpu/triton_cache.tar.xz.
(cd /tmp/jitcache && ls triton | grep -vxFf /tmp/triton_carried | sed 's#^#triton/#' | tar -cf - -T - | xz -6 -T0 > "$OUT/triton_new.tar.xz") 2>/dev/null
echo "[$(el)s] done; files: $(cd "$OUT" && ls | tr '\n' ' ')"
