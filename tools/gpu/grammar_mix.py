#!/usr/bin/env python3
"""What one grammar-constrained request costs the requests batched beside it (issue 17).

Up to overlay 0.3.0-rc.12 a DDTREE round whose batch carries a grammar falls back to the DFlash
chain round for the whole batch (and runs without CUDA graphs), so while one constrained request
runs, its unconstrained neighbours lose the tree; rc.13 and rc.14 keep it in the tree round. Per
server and prompt class (ddtree_client.py's alternating prompts, where the tree accepts 6 to the
chain's 2, and its repeating ones, where both accept everything), a batch of four greedy requests
in two modes:
- free: a companion request and three neighbours, all unconstrained;
- mixed: the same, the companion constrained by a regex that any run of lowercase words matches
  (so it never completes the grammar and stays constrained).
The companion (the class's first prompt, up to LONG tokens, its own rid) is sent first; LEAD_S
later the three neighbours (240 tokens each, ignore_eos) go in one /generate call; when that call
returns, the companion is aborted (/abort_request). So the companion is in the batch for the
neighbours' whole decode, in both modes alike, and no time after them is counted: one call of all
four (run 26's version) timed the neighbours over the call, which also ran the constrained
request alone once they were done, and a constrained request that finished first would have
handed its neighbours back to the tree. The neighbours' rate (their tokens over their call's time)
is what is reported in both modes; the companion's tokens, time and whether it was still running
when they finished ("outlived") are recorded.
Each repetition times every server in both modes, servers in an order rotated by one a repetition
(as speed_interleave.py does); the report gives medians of per-repetition ratios: mixed / free per
server (what one grammar request costs its neighbours) and each server against the first (the
baseline, e.g. DFLASH) in each mode.

usage: grammar_mix.py OUT_JSON REPEATS CASE=PORT [CASE=PORT ...]
"""
from __future__ import annotations

import json
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ddtree_client as base  # noqa: E402

GREEDY = {"temperature": 0.0, "max_new_tokens": 240, "ignore_eos": True}
# The companion's cap, 6.4 x 240 (less what it decodes alone in LEAD_S: at most ~20 rounds): it
# outlives its neighbours unless it accepts over ~5 times as many tokens a round as they do (the
# chain accepts at most 8, the neighbours 2 on alternating prompts); the copy models' context is 2048.
# Whether it did is recorded ("outlived") and counted in the report.
LONG = 1536
LEAD_S = 0.1  # the companion is prefilled and decoding before the neighbours arrive
WORDS = r"( ?[a-z]+)+"
CLASSES = {"alternating": base.ALT, "repeating": base.REP}
NEIGHBOURS = 3


def abort(url: str, rid: str) -> None:
    requests.post(url + "/abort_request", json={"rid": rid}, timeout=30).raise_for_status()


def time_mode(url: str, prompts: list[list[int]], constrained: bool) -> dict[str, Any]:
    """The neighbours' tok/s and acceptance beside one long companion, regex-constrained if
    `constrained`, and what the companion did meanwhile."""
    rid = f"grammar-mix-{uuid.uuid4().hex}"  # SGLang aborts every rid that starts with it
    companion_sp: dict[str, Any] = {**GREEDY, "max_new_tokens": LONG, **({"regex": WORDS} if constrained else {})}
    got: dict[str, Any] = {}

    def run_companion() -> None:
        try:
            got["answer"], got["secs"] = base.post(url, {"input_ids": prompts[0], "rid": rid}, companion_sp)
        except Exception as e:  # recorded, not raised: the neighbours' timing stands
            got["error"] = repr(e)[:200]
        got["end"] = time.perf_counter()

    companion = threading.Thread(target=run_companion)
    companion.start()
    time.sleep(LEAD_S)
    answers, secs = base.post(url, {"input_ids": prompts[:NEIGHBOURS]}, GREEDY)
    done = time.perf_counter()
    try:
        abort(url, rid)
    except Exception as e:  # the companion then runs to LONG: the join below waits for it
        got["abort_error"] = repr(e)[:200]
    companion.join(timeout=300)
    meta = got.get("answer", {}).get("meta_info", {})
    neighbours: list[dict[str, Any]] = answers  # type: ignore[assignment]
    return {"tok_s": sum(a["meta_info"]["completion_tokens"] for a in neighbours) / secs, "secs": secs,
            "accept": statistics.mean(a["meta_info"].get("spec_accept_length") or 1.0 for a in neighbours),
            "companion": {"tokens": meta.get("completion_tokens"), "secs": got.get("secs"),
                          "accept": meta.get("spec_accept_length"),
                          "finish": (meta.get("finish_reason") or {}).get("type"),
                          "outlived": got.get("end", float("inf")) >= done,
                          "error": got.get("error") or got.get("abort_error")}}


def time_server(url: str) -> dict[str, dict[str, Any]]:
    """One timing of every class in both modes on one server."""
    return {f"{name}_{mode}": time_mode(url, prompts, mode == "mixed")
            for name, prompts in CLASSES.items() for mode in ("free", "mixed")}


def median_ratio(top: list[dict[str, Any]], bottom: list[dict[str, Any]], top_key: str, bottom_key: str) -> float:
    return float(statistics.median(t[top_key]["tok_s"] / b[bottom_key]["tok_s"] for t, b in zip(top, bottom, strict=True)))


def summarise(timings: dict[str, list[dict[str, Any]]], baseline: str) -> dict[str, dict[str, float]]:
    """Per server and class: median neighbour tok/s and acceptance per mode, mixed / free, each
    mode against the baseline (all medians of per-repetition values), the constrained companion's
    median tokens and seconds, and how many companions (both modes) ended before their neighbours."""
    summary: dict[str, dict[str, float]] = {}
    for name, reps in timings.items():
        row: dict[str, float] = {}
        for cls in CLASSES:
            for mode in ("free", "mixed"):
                key = f"{cls}_{mode}"
                row[key] = statistics.median(r[key]["tok_s"] for r in reps)
                row[f"{key}_accept"] = statistics.median(r[key]["accept"] for r in reps)
                row[f"{key}_vs_{baseline}"] = median_ratio(reps, timings[baseline], key, key)
            row[f"{cls}_mixed_over_free"] = median_ratio(reps, reps, f"{cls}_mixed", f"{cls}_free")
            for what in ("tokens", "secs"):
                row[f"{cls}_constrained_{what}"] = statistics.median(r[f"{cls}_mixed"]["companion"][what] or 0
                                                                      for r in reps)
        row["companions_not_outliving"] = sum(not t["companion"]["outlived"] for r in reps for t in r.values())
        summary[name] = row
    return summary


def main() -> None:
    out, repeats = sys.argv[1], int(sys.argv[2])
    servers = dict(arg.split("=", 1) for arg in sys.argv[3:])
    names = list(servers)
    for name in names:  # warm-up: the first constrained request compiles the grammar
        time_server(f"http://127.0.0.1:{servers[name]}")
    timings: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for rep in range(repeats):
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            timings[name].append(time_server(f"http://127.0.0.1:{servers[name]}"))
    summary = summarise(timings, names[0])
    with open(out, "w") as f:
        json.dump({"repeats": repeats, "baseline": names[0], "long": LONG, "lead_s": LEAD_S, "timings": timings,
                   "median": summary}, f, indent=1)
    print(f"GRAMMAR_MIX {repeats} repetitions: three neighbours' tok/s beside one long companion, free or "
          f"regex-constrained (medians; ratios are medians of per-repetition ratios, against {names[0]})")
    for name in names:
        row = summary[name]
        for cls in CLASSES:
            print(f"  {name} {cls}: free {row[f'{cls}_free']:.0f} tok/s (accept {row[f'{cls}_free_accept']:.2f}, "
                  f"{row[f'{cls}_free_vs_{names[0]}']:.2f}x), mixed {row[f'{cls}_mixed']:.0f} "
                  f"(accept {row[f'{cls}_mixed_accept']:.2f}, {row[f'{cls}_mixed_vs_{names[0]}']:.2f}x); "
                  f"mixed / free {row[f'{cls}_mixed_over_free']:.2f}; constrained request "
                  f"{row[f'{cls}_constrained_tokens']:.0f} tokens in {row[f'{cls}_constrained_secs']:.2f} s")
        if row["companions_not_outliving"]:
            print(f"  {name}: {row['companions_not_outliving']:.0f} companions ended before their neighbours "
                  f"(those timings are not what this tool claims to measure)")


if __name__ == "__main__":
    main()
