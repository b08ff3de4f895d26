#!/usr/bin/env bash
# Runs ON THE GPU MACHINE from the repo root:  bash tools/gpu/deploy_on_gpu.sh
# "The tool deploys it for real": the real SGLang 0.5.17 (pristine, /tmp/site) serves the copy pair;
# ddtree-deploy (this checkout, transport: local) restarts it as the pre-push server, pushes
# ddtree $DDTREE_VERSION (default 0.2.2; snapshot, apply, restart with DDTREE, probes incl.
# lossless against the pre-push answers), then pushes a deliberately broken X.Y.99 (that version with
# its ddtree_spec.py raising at import, so the server dies at start-up), which must fail fast and roll
# back to a healthy server running the good version.
# HYBRID=1 serves the copy hybrid instead (make_hybrid.py's hyb_copy: GatedDeltaNet layers, the copy
# pair's draft, --max-running-requests 8), for 0.3.0 and later (set DDTREE_VERSION; the default is
# refused). The broken version is X.Y.99 of $DDTREE_VERSION's X.Y, so it is always newer than the good one.
# Carry: .gpu/site.tar.xz .gpu/scripts (and .gpu/jitcache.tar.gz, .gpu/triton_cache.tar.xz or .tar.gz if any).
# Everything lands in $OUT/deploy.tar.gz (transcript, JSON answers, inventory, server logs).
set -u
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
OUT=${OUT:-/tmp/out}; W=$OUT/w; mkdir -p "$W"; R=$(pwd); G=$R/.gpu; V=${DDTREE_VERSION:-0.2.2}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export TVM_FFI_CACHE_DIR=/tmp/jitcache FLASHINFER_WORKSPACE_BASE=/tmp/fi TRITON_CACHE_DIR=/tmp/jitcache/triton
pack() { (cd "$W" && tar -czf "$OUT/deploy.tar.gz" .); }   # after every stage: a timeout loses nothing
trap pack EXIT
if [ ! -f /tmp/site/.done ]; then mkdir -p /tmp/site && tar -xJf "$G/site.tar.xz" -C /tmp/site && touch /tmp/site/.done || { echo "unpack failed"; exit 1; }; fi
mkdir -p /tmp/jitcache
[ -f "$G/jitcache.tar.gz" ] && tar -xzf "$G/jitcache.tar.gz" -C /tmp/jitcache
for f in "$G"/triton_cache.tar.{xz,gz}; do [ -f "$f" ] && tar -xf "$f" -C /tmp/jitcache; done
[ -d /tmp/models/target_copy ] || PYTHONPATH=/tmp/site python3 "$G/scripts/make_models.py" /tmp/models 2>&1 | grep -v shards
MODEL=/tmp/models/target_copy EXTRA=
if [ "${HYBRID:-0}" = 1 ]; then
  case $V in 0.[012].*) echo "HYBRID=1 needs ddtree 0.3.0 or later (0.2.x refuses hybrid targets); DDTREE_VERSION is $V"; exit 2;; esac
  [ -d /tmp/models/hyb_copy ] || PYTHONPATH=/tmp/site python3 "$G/scripts/make_hybrid.py" /tmp/models 2>&1 | grep -v shards
  MODEL=/tmp/models/hyb_copy EXTRA='--max-running-requests, "8"'
fi
echo "[$(el)s] site and models ready"

# Overlays the tool sees: the repo's ddtree versions plus a broken X.Y.99 made here (version $V
# exported whole, i.e. with what it inherits, then broken).
BV=$(echo "$V" | cut -d. -f1-2).99
OV=/tmp/ovl; rm -rf "$OV"; mkdir -p "$OV"; cp -r overlays/ddtree "$OV/ddtree"
B=$OV/ddtree/$BV; PYTHONPATH=$R:/tmp/site python3 -m ddtree_deploy.cli overlay export "ddtree@$V" "$B" --overlays overlays >/dev/null
sed -i "s/^version: $V\$/version: $BV  # DELIBERATELY BROKEN (ddtree_spec.py raises at import) for the rollback proof/" "$B/overlay.yaml"
grep -q "^version: $BV " "$B/overlay.yaml" || { echo "could not mark $B/overlay.yaml as version $BV"; exit 2; }
printf 'raise RuntimeError("ddtree %s is deliberately broken (rollback proof)")\n' "$BV" >> "$B/files/sglang/srt/speculative/ddtree_spec.py"

. tools/gpu/local_host.sh
local_host_inventory "$W/inventory.yaml" "$MODEL" /tmp/models/dflash_copy 0.05 32768 4 /tmp/site 30000 "$EXTRA"
# SAMPLED=1: the host also runs the `sampled` probe (its probes list ends the file), so the push waits
# out flashinfer's sampling compile (about 104 s on a fresh machine) and the probe's time says so.
PUSH_T=300; [ "${SAMPLED:-0}" = 1 ] && echo '      - {kind: sampled}' >> "$W/inventory.yaml" && PUSH_T=420
PYTHONPATH=$R:/tmp/site python3 -m ddtree_deploy.cli overlay export "ddtree@$V" "$W/overlay-$V" --overlays overlays >/dev/null
# The tool runs from this checkout with the image's python (rich, typer, yaml, requests are there;
# pydantic comes from /tmp/site).
tool() {  # name timeout args...
  local name=$1 t=$2; shift 2
  echo; echo "[$(el)s] \$ ddtree-deploy $*" | tee -a "$W/transcript.txt"
  PYTHONPATH=$R:/tmp/site DDTREE_INVENTORY=$W/inventory.yaml DDTREE_OVERLAYS=$OV \
    timeout "$t" python3 -m ddtree_deploy.cli "$@" 2>&1 | tee -a "$W/transcript.txt"
  echo "[$(el)s] exit ${PIPESTATUS[0]}" | tee -a "$W/transcript.txt"; pack
}
tool status   60 status
# QUICK=1 (a device budget of a few minutes): no pre-push server (so no lossless reference) and no broken push.
[ "${QUICK:-0}" = 1 ] || tool start 240 restart --host h200   # the pre-push server: plain target, no DDTREE
tool push "$PUSH_T" push --host h200 --overlay "ddtree@$V"  # snapshot, apply, restart with DDTREE, probes
tool status2  60 status
timeout 30 python3 - <<'PY' 2>&1 | tee -a "$W/transcript.txt"   # pip's RECORD after the push, read as pip reads it
import base64, hashlib, importlib.metadata, pathlib
site = pathlib.Path("/tmp/site"); dist = importlib.metadata.Distribution.at(next(site.glob("sglang-*.dist-info")))
files = dist.files or []; wrong = []
for f in files:
    if f.hash and (site / f).is_file():
        data = (site / f).read_bytes()
        if f.hash.value != base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode().rstrip("=") or f.size != len(data):
            wrong.append(str(f))
ddtree = sorted(str(f) for f in files if "ddtree" in str(f))
on_disk = sorted(str(p.relative_to(site)) for p in (site / "sglang").rglob("*ddtree*.py"))
print(f"RECORD after the push: {len(files)} rows; listed ddtree files {ddtree}; on disk {on_disk}; rows whose hash or size is stale: {wrong or 'none'}")
PY
timeout 30 python3 - <<'PY' 2>&1 | tee -a "$W/transcript.txt"   # one alternating prompt on the deployed server
import json, time, urllib.request
body = {"input_ids": [262, 263] * 4, "sampling_params": {"temperature": 0, "max_new_tokens": 240, "ignore_eos": True}}
t = time.perf_counter()
req = urllib.request.Request("http://127.0.0.1:30000/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
meta = json.load(urllib.request.urlopen(req, timeout=25))["meta_info"]
print("deployed server, alternating prompt:", {k: meta.get(k) for k in ("completion_tokens", "spec_accept_length", "spec_verify_ct")},
      f"{meta['completion_tokens'] / (time.perf_counter() - t):.0f} tok/s")
PY
[ "${QUICK:-0}" = 1 ] || tool broken 300 push --host h200 --overlay "ddtree@$BV"  # must fail fast and roll back
tool status3  60 status
tool json     60 status --json
(cd /tmp && tar -cf - --exclude="ddtree-state/*/objects" ddtree-state) | tar -xf - -C "$W" 2>/dev/null  # not the 73 MB of objects: the tarball must come back
[ -d /tmp/jitcache/triton ] && tar -czf "$OUT/triton_cache.tar.gz" -C /tmp/jitcache triton
echo "[$(el)s] done"
