#!/usr/bin/env python3
"""Compare a case's greedy outputs with the reference (plain) case token by token;
for every split, ask the still-running reference server for its top-2 log-probs at
the split position, so a split can be shown to be a near-tie (or not).

usage: ddtree_compare.py REF.json CASE.json LABEL [REF_PORT]
Prints one line per prompt and a summary line GREEDY_MATCH[LABEL] k/n.
"""
from __future__ import annotations

import json
import sys

import requests


def top2_at(port: int, prompt: object, pos: int) -> list[tuple[float, int]]:
    """Reference top-2 (logprob, token) at output position ``pos`` (batch 1)."""
    body = {"text": prompt} if isinstance(prompt, str) else {"input_ids": prompt}
    body.update(return_logprob=True, top_logprobs_num=2,
                sampling_params={"temperature": 0.0, "max_new_tokens": pos + 1, "ignore_eos": True})
    x = requests.post(f"http://127.0.0.1:{port}/generate", json=body, timeout=120).json()
    return [(round(lp, 4), tok) for lp, tok, *_ in x["meta_info"]["output_top_logprobs"][pos]]


def main() -> None:
    ref, case = (json.load(open(f)) for f in sys.argv[1:3])
    label = sys.argv[3]
    port = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    same = total = 0
    for mode in ("single", "batch4"):
        for x, y in zip(ref[mode], case[mode], strict=True):
            a, b = x["output_ids"] or [], y["output_ids"] or []
            total += 1
            first = next((i for i, (p, q) in enumerate(zip(a, b, strict=False)) if p != q), None)
            if a == b:
                same += 1
            m = y["meta"]
            acc = f" accept_len={m['spec_accept_length']:.2f}" if "spec_accept_length" in m else ""
            line = f"  {mode:6s} {str(x['prompt'])[:30]!r:33s} identical={a == b} first_diff={first}{acc}"
            if first is not None and port:
                t2 = top2_at(port, x["prompt"], first)
                gap = t2[0][0] - t2[1][0] if len(t2) > 1 else None
                line += f" ref_top2={t2} case_token={b[first]} gap={gap}"
            print(line)
    print(f"GREEDY_MATCH[{label}] {same}/{total} identical ->", "YES" if same == total else "NO")


if __name__ == "__main__":
    main()
