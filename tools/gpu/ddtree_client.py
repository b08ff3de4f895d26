#!/usr/bin/env python3
"""Drive one running SGLang server for the DDTREE proof: greedy outputs (batch 1 and
batch 4), decode speed and acceptance on the copy pair's alternating and repeating
prompts, and a few sampled (T > 0) requests.

usage: ddtree_client.py PORT OUT_JSON
"""
from __future__ import annotations

import json
import sys
import time

import requests

TEXTS = [
    "hello world the model token",
    "the draft block is verified by the target",
    "one two three four five six seven eight nine ten",
    "kernel graph memory decode prefill verify accept",
]
IDS = [[100, 200, 300, 900], [50, 60, 70, 80], [10, 20, 300], [1000, 400, 301, 257], [700, 12, 800, 5, 650]]
# target_copy: f(t) = t xor 1 on [256, 512) -> the output alternates and the draft's
# majority vote over the context nearly ties between two tokens.
ALT = [[256 + 2 * k, 257 + 2 * k] * 4 for k in (3, 20, 60)]
# f(t) = t on [0, 256) -> the output repeats; the draft is right almost always.
REP = [[5 + k] * 8 for k in (0, 40, 90)]
KEEP = ("spec_accept_length", "spec_accept_rate", "spec_verify_ct", "completion_tokens", "prompt_tokens")


def post(url: str, payload: dict, sp: dict) -> tuple[object, float]:
    t = time.perf_counter()
    r = requests.post(url + "/generate", json={**payload, "sampling_params": sp}, timeout=300)
    r.raise_for_status()
    return r.json(), time.perf_counter() - t


def rec(prompt: object, x: dict, secs: float | None = None) -> dict:
    d = {"prompt": prompt, "output_ids": x.get("output_ids"),
         "meta": {k: v for k, v in x["meta_info"].items() if k in KEEP}}
    if secs is not None:
        d["secs"] = round(secs, 4)
    return d


def payload(p: object) -> dict:
    return {"text": p} if isinstance(p, str) else {"input_ids": p}


def main() -> None:
    port, out = int(sys.argv[1]), sys.argv[2]
    url = f"http://127.0.0.1:{port}"
    greedy = {"temperature": 0.0, "max_new_tokens": 64, "ignore_eos": True}
    res: dict = {"server_info": requests.get(url + "/server_info", timeout=30).json()}
    post(url, payload(IDS[0]), greedy)  # warm-up
    prompts = TEXTS + IDS + ALT + REP
    res["single"] = [rec(p, *post(url, payload(p), greedy)) for p in prompts]
    res["batch4"] = []
    for group in (TEXTS, IDS[:4], ALT + REP[:1], REP):
        xs, _ = post(url, {"text": group} if isinstance(group[0], str) else {"input_ids": group}, greedy)
        res["batch4"] += [rec(p, x) for p, x in zip(group, xs, strict=True)]
    # 240 new tokens: a multiple of every steady-state round length of these prompts (2, 6, 8),
    # so the last round is not cut short by max_new_tokens and skews no acceptance average.
    speed = {"temperature": 0.0, "max_new_tokens": 240, "ignore_eos": True}
    for name, group in (("alternating", ALT), ("repeating", REP)):
        runs = [rec(p, *post(url, payload(p), speed)) for p in group + group]  # each prompt twice
        toks = sum(r["meta"]["completion_tokens"] for r in runs)
        secs = sum(r["secs"] for r in runs)
        xs, bsecs = post(url, {"input_ids": group + group[:1]}, speed)
        res[f"speed_{name}"] = {
            "runs": runs, "tokens": toks, "secs": round(secs, 4), "tok_per_s": round(toks / secs, 1),
            "accept_length": [r["meta"].get("spec_accept_length") for r in runs],
            "batch4_tok_per_s": round(sum(x["meta_info"]["completion_tokens"] for x in xs) / bsecs, 1),
            "batch4_accept_length": [x["meta_info"].get("spec_accept_length") for x in xs],
        }
    sampled = {"temperature": 0.8, "top_p": 0.95, "max_new_tokens": 48, "ignore_eos": True}
    res["sampled"] = [rec(p, *post(url, payload(p), sampled)) for p in ALT[:2] + REP[:1]]
    xs, _ = post(url, {"input_ids": ALT + REP[:1]}, sampled)
    res["sampled"] += [rec(p, x) for p, x in zip(ALT + REP[:1], xs, strict=True)]
    json.dump(res, open(out, "w"), indent=1)
    for name in ("alternating", "repeating"):
        s = res[f"speed_{name}"]
        print(f"  {name}: {s['tok_per_s']} tok/s (batch 1), {s['batch4_tok_per_s']} tok/s (batch 4), accept {s['accept_length']}")


if __name__ == "__main__":
    main()
