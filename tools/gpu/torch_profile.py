#!/usr/bin/env python3
"""Profile one running SGLang server's scheduler with the torch profiler, and summarise the trace.

usage: torch_profile.py run PORT OUT_DIR LABEL [STEPS=40]     # /start_profile, repeating prompts, summary
       torch_profile.py summarize LABEL STEPS TRACE [TRACE...]  # a chrome trace (.json or .json.gz)

`run` asks the server for STEPS forward steps of CPU and GPU activity (SGLang's /start_profile stops by
itself after them), sends the copy pair's repeating prompts at batch 1 until a trace lands in
OUT_DIR, then prints the summary. Unlike SGLANG_DDTREE_PROFILE (CUDA events every round, which cost
run 17 about 40%), the profiler runs only for those steps, and it sees every kernel of the round,
DFLASH's as well as DDTREE's, so two servers of one call compare stage by stage.

The summary, per step: GPU kernel time and count, the trace's wall span (idle time between the
client's requests included, and the few prefills among the steps), and the kernels and CPU ops with
the most total time (a CPU op's time includes the ops it calls). SGLang's profiler never calls
`prof.step()`, so the trace has no step markers: STEPS is what was asked for. Stacks and shapes are
not recorded (SGLang records both unless told not to), so CPU op times stay close to unprofiled.
"""
from __future__ import annotations

import gzip
import json
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

TOP = 12


def load_events(path: Path) -> list[dict]:
    raw = gzip.open(path, "rt").read() if path.suffix == ".gz" else path.read_text()
    data = json.loads(raw)
    return data["traceEvents"] if isinstance(data, dict) else data


def summarize(label: str, paths: list[Path], steps: int) -> list[str]:
    events = [e for p in paths for e in load_events(p) if e.get("ph") == "X" and "dur" in e]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    cpu_ops = [e for e in events if e.get("cat") == "cpu_op"]
    span = (max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)) if events else 0.0
    lines = [f"TPROF[{label}] {steps} steps: GPU kernels {sum(e['dur'] for e in kernels) / steps / 1000:.3f} ms "
             f"in {len(kernels) / steps:.0f} launches per step; wall span {span / steps / 1000:.3f} ms per step "
             f"(idle between requests included)"]
    for kind, rows in (("kernel", kernels), ("cpu_op", cpu_ops)):
        total: dict[str, float] = defaultdict(float)
        count: Counter[str] = Counter()
        for e in rows:
            total[e["name"]] += e["dur"]
            count[e["name"]] += 1
        for name, us in sorted(total.items(), key=lambda kv: -kv[1])[:TOP]:
            lines.append(f"  {kind:6} {us / steps / 1000:8.3f} ms/step {count[name] / steps:6.1f}x  {name[:110]}")
    return lines


def run(port: int, out_dir: Path, label: str, steps: int) -> list[str]:
    import requests

    url = f"http://127.0.0.1:{port}"
    out_dir.mkdir(parents=True, exist_ok=True)
    requests.post(url + "/start_profile", json={"output_dir": str(out_dir), "num_steps": steps, "with_stack": False,
                                                "record_shapes": False, "activities": ["CPU", "GPU"]},
                  timeout=60).raise_for_status()
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not list(out_dir.rglob("*.trace.json*")):
        for k in (0, 40, 90):  # make_models.py's copy target repeats tokens below 256: the draft is always right
            requests.post(url + "/generate", json={"input_ids": [5 + k] * 8, "sampling_params": {
                "temperature": 0, "max_new_tokens": 96, "ignore_eos": True}}, timeout=120).raise_for_status()
    traces = sorted(out_dir.rglob("*.trace.json*"))
    if not traces:
        return [f"TPROF[{label}] no trace in {out_dir} after 240 s"]
    return summarize(label, traces, steps)


def main() -> None:
    if sys.argv[1] == "run":
        lines = run(int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4], int(sys.argv[5]) if len(sys.argv) > 5 else 40)
    else:
        lines = summarize(sys.argv[2], [Path(p) for p in sys.argv[4:]], int(sys.argv[3]))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
