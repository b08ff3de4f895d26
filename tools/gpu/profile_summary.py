#!/usr/bin/env python3
"""Summarise a DDTREE server log's `ddtree_profile {json}` lines (SGLANG_DDTREE_PROFILE=1, overlay 0.3.0-rc.4+).

usage: profile_summary.py LABEL SERVER_LOG
Prints one row per stage: the median over the lines of its GPU and host milliseconds per round, and
the share of the round; then the round and the lines' batch sizes. Medians, not means: a line whose
rounds span a pause between requests (the idle gap lands in one stage) or the first compile holds
stage times 100x the others (run 17: a mean `picks` of 125 ms against a median of 0.008). Each
client phase (batch 1, batch 4) writes its own lines, so the table mixes them unless the log holds one.
"""
from __future__ import annotations

import json
import statistics
import sys


def main() -> None:
    label, log = sys.argv[1], sys.argv[2]
    lines = [json.loads(row.split("ddtree_profile ", 1)[1]) for row in open(log, errors="replace")
             if "ddtree_profile {" in row]
    if not lines:
        print(f"PROFILE[{label}] no ddtree_profile lines")
        return
    rounds = sum(x["rounds"] for x in lines)
    stages = list(lines[0]["gpu_ms"])
    gpu = {s: statistics.median(x["gpu_ms"][s] for x in lines) for s in stages}
    host = {s: statistics.median(x["host_ms"][s] for x in lines) for s in stages}
    total_gpu, total_host = sum(gpu.values()), sum(host.values())
    print(f"PROFILE[{label}] {rounds} rounds in {len(lines)} lines, batch sizes "
          f"{sorted({x['bs_mean'] for x in lines})}")
    print(f"  {'stage':14s} {'gpu ms':>8s} {'share':>6s} {'host ms':>8s} {'share':>6s}")
    for s in stages:
        print(f"  {s:14s} {gpu[s]:8.3f} {gpu[s] / total_gpu:6.1%} {host[s]:8.3f} {host[s] / total_host:6.1%}")
    print(f"  {'round':14s} {total_gpu:8.3f} {'':6s} {total_host:8.3f}")


if __name__ == "__main__":
    main()
