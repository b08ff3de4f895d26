# Sourced by the GPU scripts that run ddtree-deploy itself on the GPU machine (deploy_on_gpu.sh,
# bench_sweep.sh): `local_host_inventory FILE MODEL DRAFT MEM_FRACTION MAX_TOKENS MAX_BS [SITE [PORT [EXTRA]]]`
# writes an inventory of one `transport: local` host, h200, whose package root is SITE (default the
# unpacked /tmp/site) and whose process service is the real `sglang.launch_server` on MODEL with DRAFT
# at PORT (default 30000; CUDA graphs on, triton attention, the image's python; a start compiles
# kernels, so ready_timeout_s is generous). EXTRA: more server args as YAML list items, e.g.
# '--max-running-requests, "8"' (a hybrid target's DDTREE needs it).
local_host_inventory() {
  local file=$1 model=$2 draft=$3 mem=$4 tokens=$5 bs=$6 site=${7:-/tmp/site} port=${8:-30000} extra=${9:+, $9} py
  py=$(command -v python3)
  cat > "$file" <<YAML
hosts:
  h200:
    transport: local
    python: $py
    package_root: $site
    state_dir: /tmp/ddtree-state
    env: {PYTHONPATH: $site}
    service:
      kind: process
      command: [$py, -m, sglang.launch_server]
      args: [--model-path, $model, --speculative-draft-model-path, $draft,
             --host, 127.0.0.1, --port, "$port", --attention-backend, triton, --sampling-backend, pytorch,
             --mem-fraction-static, "$mem", --max-total-tokens, "$tokens", --context-length, "2048",
             --cuda-graph-max-bs-decode, "$bs", --disable-prefill-cuda-graph, --random-seed, "0"$extra]
      env: {PYTHONPATH: $site, HF_HUB_OFFLINE: "1", TRANSFORMERS_OFFLINE: "1",
            TVM_FFI_CACHE_DIR: /tmp/jitcache, TRITON_CACHE_DIR: /tmp/jitcache/triton, FLASHINFER_WORKSPACE_BASE: /tmp/fi}
      port: $port
      ready_timeout_s: 300
      stop_grace_s: 10
    probes:
      - {kind: http, path: /health, status: 200}
YAML
}
