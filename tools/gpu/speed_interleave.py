#!/usr/bin/env python3
"""Decode speed of several running servers, interleaved, for medians: each repetition times every
server once, in an order rotated by one server per repetition, so a slow stretch of the machine
falls on all of them. Per server and prompt class (ddtree_client.py's alternating and repeating
prompts, 240 new tokens): tokens/s at batch 1 (the class's three prompts, one after another) and at
batch 4 (one call), and the acceptance length. Then the median over the repetitions, and each
server's median ratio to the baseline server (the first CASE=PORT given, e.g. DFLASH), computed
per repetition before the median is taken, with its min and max and a bootstrap 95% interval of that
median (4,000 resamples, seeded): the min and max show how wide single repetitions spread, the
interval whether the median is resolved (run 34: 41 repetitions gave 1.07x [0.69, 1.51], 95%
1.01-1.10).
SPEED_CONTEXTS=0,1000,1700 (default 0) also times each class after a longer context: its prompts
repeated to that many tokens, keeping their pattern (keys such as repeating_c1000_b1). A tree's
verify attends over the whole context for every node, so its lead may shrink as the context grows.

usage: speed_interleave.py OUT_JSON REPEATS CASE=PORT [CASE=PORT ...]
       speed_interleave.py ratios SPEED_JSON CASE OTHER   (CASE / OTHER per repetition, from a run's file)
"""
from __future__ import annotations

import json
import os
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ddtree_client as base  # noqa: E402

SPEED = {"temperature": 0.0, "max_new_tokens": 240, "ignore_eos": True}
CLASSES = {"alternating": base.ALT, "repeating": base.REP}


def stretched(prompt: list[int], length: int) -> list[int]:
    """The prompt repeated (its pattern kept) to ``length`` tokens."""
    return (prompt * -(-length // len(prompt)))[:length]


def classes(contexts: list[int]) -> dict[str, list[list[int]]]:
    """The prompt classes, and for each context length above 0 the same classes stretched to it."""
    out = dict(CLASSES)
    for length in (c for c in contexts if c > 0):
        out.update({f"{name}_c{length}": [stretched(p, length) for p in group] for name, group in CLASSES.items()})
    return out


def time_server(url: str, prompt_classes: dict[str, list[list[int]]]) -> dict[str, float]:
    """One timing of every class and batch size on one server."""
    out: dict[str, float] = {}
    for name, group in prompt_classes.items():
        runs = [base.post(url, base.payload(p), SPEED) for p in group]
        tokens = sum(x["meta_info"]["completion_tokens"] for x, _ in runs)
        out[f"{name}_b1"] = tokens / sum(secs for _, secs in runs)
        out[f"{name}_b1_accept"] = statistics.mean(x["meta_info"].get("spec_accept_length") or 1.0 for x, _ in runs)
        xs, secs = base.post(url, {"input_ids": group + group[:1]}, SPEED)
        out[f"{name}_b4"] = sum(x["meta_info"]["completion_tokens"] for x in xs) / secs
    return out


def median_interval(values: list[float], resamples: int = 4000, seed: int = 0) -> tuple[float, float]:
    """A bootstrap 95% interval of the median of ``values`` (percentiles of resampled medians)."""
    draw = random.Random(seed)
    medians = sorted(statistics.median(draw.choices(values, k=len(values))) for _ in range(resamples))
    return medians[resamples // 40], medians[resamples - resamples // 40 - 1]


def ratios(timings: dict[str, list[dict[str, float]]], case: str, other: str) -> dict[str, list[float]]:
    """Per tok/s key: the median, min and max over the repetitions of case / other, then the bounds of
    the median's bootstrap 95% interval."""
    out = {}
    for k in (k for k in timings[other][0] if not k.endswith("_accept")):
        r = [t[k] / o[k] for t, o in zip(timings[case], timings[other], strict=True)]
        out[k] = [statistics.median(r), min(r), max(r), *median_interval(r)]
    return out


def ratio_text(mid: float, low: float, high: float, low95: float, high95: float) -> str:
    return f"{mid:.2f}x [{low:.2f}, {high:.2f}] 95% {low95:.2f}-{high95:.2f}"


def main() -> None:
    if sys.argv[1] == "ratios":
        case, other = sys.argv[3], sys.argv[4]
        for k, bounds in ratios(json.load(open(sys.argv[2]))["timings"], case, other).items():
            print(f"  {case} / {other} {k}: {ratio_text(*bounds)}")
        return
    out, repeats = sys.argv[1], int(sys.argv[2])
    servers = dict(arg.split("=", 1) for arg in sys.argv[3:])
    prompt_classes = classes([int(c) for c in os.environ.get("SPEED_CONTEXTS", "0").split(",")])
    names = list(servers)
    for name in names:  # warm-up: first requests compile and fill caches
        base.post(f"http://127.0.0.1:{servers[name]}", base.payload(base.REP[0]), SPEED)
    timings: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for rep in range(repeats):
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            timings[name].append(time_server(f"http://127.0.0.1:{servers[name]}", prompt_classes))
    baseline = names[0]
    keys = [k for k in timings[baseline][0] if not k.endswith("_accept")]
    summary: dict[str, dict[str, float]] = {}
    for name in names:
        row = {k: statistics.median(t[k] for t in timings[name]) for k in timings[name][0]}
        for k, (mid, low, high, low95, high95) in ratios(timings, name, baseline).items():
            row[f"{k}_vs_{baseline}"] = mid
            row[f"{k}_vs_{baseline}_range"] = [low, high]  # type: ignore[assignment]
            row[f"{k}_vs_{baseline}_interval"] = [low95, high95]  # type: ignore[assignment]
        summary[name] = row
    json.dump({"repeats": repeats, "baseline": baseline, "timings": timings, "median": summary}, open(out, "w"), indent=1)
    print(f"SPEED interleaved, {repeats} repetitions, median tok/s (ratio to {baseline}: median [min, max] 95% interval)")
    for name in names:
        row = summary[name]
        cells = [f"{k} {row[k]:.0f} ({ratio_text(row[f'{k}_vs_{baseline}'], *row[f'{k}_vs_{baseline}_range'], *row[f'{k}_vs_{baseline}_interval'])})"
                 for k in keys]
        accept = ", ".join(f"{k[:-7]} accept {row[k]:.2f}" for k in row if k.endswith("_accept"))
        print(f"  {name}: " + "; ".join(cells) + f"; {accept}")


if __name__ == "__main__":
    main()
