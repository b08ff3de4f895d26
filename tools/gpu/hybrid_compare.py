#!/usr/bin/env python3
"""Beside ddtree_compare.py for hybrid cases: the regex-constrained greedy outputs against the
plain case's, how many sampled regex-constrained outputs stay within the regex, the sampled request's latency, and tokens/s with acceptance.

usage: hybrid_compare.py REF.json CASE.json LABEL
"""
from __future__ import annotations

import json
import sys


def main() -> None:
    ref, case = (json.load(open(f)) for f in sys.argv[1:3])
    if "grammar" not in case or "grammar" not in ref:
        return  # a greedy-only client (hybrid_client.py ... greedy)
    same = sum(a.get("output_ids") == b.get("output_ids") and "error" not in b
               for a, b in zip(ref["grammar"], case["grammar"], strict=True))
    speed = {name: (case[f"speed_{name}"]["tok_per_s"], case[f"speed_{name}"]["batch4_tok_per_s"],
                    case[f"speed_{name}"]["accept_length"][:1]) for name in ("alternating", "repeating")}
    sampled = case.get("grammar_sampled", [])
    answered = [s for s in sampled if s["matches"] is not None]
    matching = f"{sum(s['matches'] for s in answered)}/{len(answered)} ({len(sampled) - len(answered)} errors)"
    print(f"HYBRID[{sys.argv[3]}] grammar {same}/{len(ref['grammar'])} identical, sampled (top-k 20) {matching} "
          f"within the regex; sampled {case['sampled']}; "
          f"tok/s (b1, b4, accept) {speed}")


if __name__ == "__main__":
    main()
