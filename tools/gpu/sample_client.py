#!/usr/bin/env python3
"""Draw many sampled continuations from one running SGLang server, for the lossless-in-distribution
check of the top-k/top-p rule on the GPU (sample_compare.py reads the output).

usage: sample_client.py PORT OUT_JSON [N_PER_SETTING=1000]

Two settings on the random target (a random draft, so every token after the first is drawn by the
speculative verify). Its next-token distribution is peaked, so the temperature is 3, where the top
three hold 0.4-0.99 of it. JOINT sets top_k 3 and top_p 0.55: plain decoding keeps a token if the
tokens above it hold at most 0.55 of the full distribution, SGLang's DFLASH verify if they hold at
most 0.55 after renormalising over the top three, so it keeps fewer (e.g. top three holding 0.44
with renormalised shares 0.5, 0.32, 0.18: plain keeps three, DFLASH two). TOPK_ONLY sets top_k 3
alone, where every rule is the same (the control). SAMPLE_TOP_P replaces 0.55: run 20 found a
context whose top two hold 0.5447, where the verify's bf16 logits and plain decoding's fall on
opposite sides of 0.55.
"""
from __future__ import annotations

import json
import os
import sys

import requests

PROMPTS = [[100, 200, 300, 900], [50, 60, 70, 80], [10, 20, 300], [700, 12, 800, 5, 650]]
SETTINGS = {
    "joint": {"temperature": 3.0, "top_k": 3, "top_p": float(os.environ.get("SAMPLE_TOP_P", "0.55"))},
    "topk_only": {"temperature": 3.0, "top_k": 3},
}
NEW_TOKENS, BATCH = 4, 60


def draw(url: str, sampling: dict, n: int) -> list[dict]:
    """n continuations, the prompts taken in turn, BATCH requests per /generate call."""
    rows = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
    sp = {**sampling, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    out: list[dict] = []
    for start in range(0, n, BATCH):
        chunk = rows[start:start + BATCH]
        r = requests.post(url + "/generate", json={"input_ids": chunk, "sampling_params": sp}, timeout=300)
        r.raise_for_status()
        out += [{"prompt": p, "output_ids": x["output_ids"]} for p, x in zip(chunk, r.json(), strict=True)]
    return out


def main() -> None:
    port, path = int(sys.argv[1]), sys.argv[2]
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 1000
    url = f"http://127.0.0.1:{port}"
    res = {"settings": SETTINGS, "samples": {name: draw(url, sp, n) for name, sp in SETTINGS.items()}}
    json.dump(res, open(path, "w"))
    print(f"  {n} samples per setting: {', '.join(SETTINGS)}")


if __name__ == "__main__":
    main()
