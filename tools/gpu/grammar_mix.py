#!/usr/bin/env python3
"""What one grammar-constrained request costs the requests batched beside it (issue 17).

A DDTREE round whose batch carries a grammar falls back to the DFlash chain round for the whole
batch, so while one constrained request runs, its unconstrained neighbours lose the tree. Per
server and prompt class (ddtree_client.py's alternating prompts, where the tree accepts 6 to the
chain's 2, and its repeating ones, where both accept everything), one /generate call of four
requests decoded together, 240 greedy tokens each, in two modes:
- free: four unconstrained requests;
- mixed: the same four, the last constrained by a regex that any run of lowercase words matches
  (so it stays constrained for all of its 240 tokens and the batch never leaves the fallback).
The neighbours' rate is the first three requests' tokens over the call's time. Each repetition
times every server in both modes, servers in an order rotated by one a repetition (as
speed_interleave.py does); the report gives medians of per-repetition ratios: mixed / free per
server (what one grammar request costs its neighbours) and each server against the first (the
baseline, e.g. DFLASH) in each mode.

usage: grammar_mix.py OUT_JSON REPEATS CASE=PORT [CASE=PORT ...]
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ddtree_client as base  # noqa: E402

GREEDY = {"temperature": 0.0, "max_new_tokens": 240, "ignore_eos": True}
WORDS = r"( ?[a-z]+)+"
CLASSES = {"alternating": base.ALT, "repeating": base.REP}
NEIGHBOURS = 3


def batch(prompts: list[list[int]], constrained: bool) -> tuple[dict, list[dict]]:
    """The payload and per-request sampling parameters of one four-request call."""
    four = (prompts + prompts)[:NEIGHBOURS + 1]
    params = [dict(GREEDY) for _ in four]
    if constrained:
        params[-1]["regex"] = WORDS
    return {"input_ids": four}, params


def time_mode(url: str, prompts: list[list[int]], constrained: bool) -> dict[str, float]:
    payload, params = batch(prompts, constrained)
    answers, secs = base.post(url, payload, params)  # type: ignore[arg-type]
    neighbours = answers[:NEIGHBOURS]  # type: ignore[index]
    return {"tok_s": sum(a["meta_info"]["completion_tokens"] for a in neighbours) / secs,
            "accept": statistics.mean(a["meta_info"].get("spec_accept_length") or 1.0 for a in neighbours),
            "constrained_tokens": answers[-1]["meta_info"]["completion_tokens"] if constrained else 0}  # type: ignore[index]


def time_server(url: str) -> dict[str, dict[str, float]]:
    """One timing of every class in both modes on one server."""
    return {f"{name}_{mode}": time_mode(url, prompts, mode == "mixed")
            for name, prompts in CLASSES.items() for mode in ("free", "mixed")}


def median_ratio(top: list[dict], bottom: list[dict], top_key: str, bottom_key: str) -> float:
    return statistics.median(t[top_key]["tok_s"] / b[bottom_key]["tok_s"] for t, b in zip(top, bottom, strict=True))


def summarise(timings: dict[str, list[dict]], baseline: str) -> dict[str, dict[str, float]]:
    """Per server and class: median neighbour tok/s and acceptance per mode, mixed / free, and each
    mode against the baseline, all medians of per-repetition values."""
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
        summary[name] = row
    return summary


def main() -> None:
    out, repeats = sys.argv[1], int(sys.argv[2])
    servers = dict(arg.split("=", 1) for arg in sys.argv[3:])
    names = list(servers)
    for name in names:  # warm-up: the first constrained request compiles the grammar
        time_server(f"http://127.0.0.1:{servers[name]}")
    timings: dict[str, list[dict]] = {name: [] for name in names}
    for rep in range(repeats):
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            timings[name].append(time_server(f"http://127.0.0.1:{servers[name]}"))
    summary = summarise(timings, names[0])
    json.dump({"repeats": repeats, "baseline": names[0], "timings": timings, "median": summary}, open(out, "w"),
              indent=1)
    print(f"GRAMMAR_MIX {repeats} repetitions: neighbours' tok/s beside one regex request (median; ratios are "
          f"medians of per-repetition ratios, against {names[0]})")
    for name in names:
        row = summary[name]
        for cls in CLASSES:
            print(f"  {name} {cls}: free {row[f'{cls}_free']:.0f} tok/s (accept {row[f'{cls}_free_accept']:.2f}, "
                  f"{row[f'{cls}_free_vs_{names[0]}']:.2f}x), mixed {row[f'{cls}_mixed']:.0f} "
                  f"(accept {row[f'{cls}_mixed_accept']:.2f}, {row[f'{cls}_mixed_vs_{names[0]}']:.2f}x); "
                  f"mixed / free {row[f'{cls}_mixed_over_free']:.2f}")


if __name__ == "__main__":
    main()
