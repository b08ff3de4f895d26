#!/usr/bin/env python3
"""Drive one server on a tiny hybrid (GatedDeltaNet) target: ddtree_client.py's greedy
prompts (batch 1 and batch 4) and speed runs, then a regex-constrained greedy request (the
grammar rounds are tree rounds from overlay 0.3.0-rc.13, a DFlash chain fallback through the
same hybrid backend before) and one
sampled request with a short timeout, timed (a T = 0.8 request on a hybrid DFLASH server
with CUDA graphs was seen waiting 85-110 s before its prefill).

usage: hybrid_client.py PORT OUT_JSON [greedy | induct]
With `greedy`, only the greedy prompts (for slow eager debug servers). With `induct`, only greedy
prompts of INDUCT (for make_induction_hybrid.py's target, whose other tokens all tie).
"""
from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ddtree_client as base  # noqa: E402

GRAMMAR_PROMPTS = base.ALT[:2] + base.REP[:1]
# Any run of the tokenizer's lowercase words: the grammar masks most of the vocabulary.
REGEX = r"( ?[a-z]+){4,24}"
PREFIX = r"(?: ?[a-z])* ?"  # a prefix of a REGEX match (cut off by max_new_tokens); linear to check
# hyb_induct: tokens 4..63 with repeats, so every step reads layer 0's recurrent state; the second
# and third end on the same token after different histories.
INDUCT = [[5, 6, 7, 8, 5], [6, 7, 5, 6], [6, 8, 5, 6], [20, 21, 22, 20, 23, 24, 20],
          [10, 11, 12, 13, 14, 15, 10], [30, 31, 32, 33], [40, 41, 42, 43, 44, 45, 46, 47, 40], [50, 51, 50, 52, 50]]


def main() -> None:
    port, out = int(sys.argv[1]), sys.argv[2]
    url = f"http://127.0.0.1:{port}"
    greedy = {"temperature": 0.0, "max_new_tokens": 64, "ignore_eos": True}
    res: dict = {"server_info": requests.get(url + "/server_info", timeout=30).json()}
    base.post(url, base.payload(base.IDS[0]), greedy)  # warm-up
    induct = sys.argv[3:] == ["induct"]
    prompts = INDUCT if induct else base.TEXTS + base.IDS + base.ALT + base.REP
    res["single"] = [base.rec(p, *base.post(url, base.payload(p), greedy)) for p in prompts]
    res["batch4"] = []
    groups = (INDUCT[:4], INDUCT[4:]) if induct else (base.TEXTS, base.IDS[:4], base.ALT + base.REP[:1], base.REP)
    for group in groups:
        key = "text" if isinstance(group[0], str) else "input_ids"
        xs, _ = base.post(url, {key: group}, greedy)
        res["batch4"] += [base.rec(p, x) for p, x in zip(group, xs, strict=True)]
    if sys.argv[3:] in (["greedy"], ["induct"]):
        json.dump(res, open(out, "w"), indent=1)
        return
    res.update(speed_and_extras(url, greedy))
    json.dump(res, open(out, "w"), indent=1)
    for name in ("alternating", "repeating"):
        s = res[f"speed_{name}"]
        print(f"  {name}: {s['tok_per_s']} tok/s (batch 1), {s['batch4_tok_per_s']} tok/s (batch 4), "
              f"accept {s['accept_length']}")
    print(f"  grammar: {[g.get('output_ids', g.get('error'))[:8] for g in res['grammar']]}; sampled: {res['sampled']}")


def timed(url: str, prompt: object, sp: dict, timeout: float) -> dict:
    t = time.perf_counter()
    try:
        body = {**base.payload(prompt), "sampling_params": sp}
        x = requests.post(url + "/generate", json=body, timeout=timeout).json()
        return {**base.rec(prompt, x, time.perf_counter() - t), "text": x["text"]}
    except (requests.RequestException, KeyError, ValueError) as e:  # a timeout, or an error answer
        return {"prompt": prompt, "secs": round(time.perf_counter() - t, 2), "error": repr(e)[:200]}


def regex_sampled(url: str, prompt: object) -> dict:
    answer = timed(url, prompt, {"temperature": 0.8, "top_k": 20, "max_new_tokens": 24, "regex": REGEX}, 30)
    return {**answer, "matches": None if "error" in answer else re.fullmatch(PREFIX, answer["text"]) is not None}


def speed_and_extras(url: str, greedy: dict) -> dict:
    res: dict = {}
    speed = {"temperature": 0.0, "max_new_tokens": 240, "ignore_eos": True}
    for name, group in (("alternating", base.ALT), ("repeating", base.REP)):
        runs = [base.rec(p, *base.post(url, base.payload(p), speed)) for p in group + group]
        toks = sum(r["meta"]["completion_tokens"] for r in runs)
        secs = sum(r["secs"] for r in runs)
        xs, bsecs = base.post(url, {"input_ids": group + group[:1]}, speed)
        res[f"speed_{name}"] = {
            "tokens": toks, "secs": round(secs, 4), "tok_per_s": round(toks / secs, 1),
            "accept_length": [r["meta"].get("spec_accept_length") for r in runs],
            "batch4_tok_per_s": round(sum(x["meta_info"]["completion_tokens"] for x in xs) / bsecs, 1),
            "batch4_accept_length": [x["meta_info"].get("spec_accept_length") for x in xs],
        }
    res["grammar"] = [timed(url, p, {**greedy, "max_new_tokens": 24, "regex": REGEX}, 30) for p in GRAMMAR_PROMPTS]
    # Sampled under the regex with a truncating sampler (top-k): overlay 0.3.0-rc.14 draws every pick
    # on such a request's path again from the masked logits. Not comparable token for token: its
    # text must be a prefix of a match (max_new_tokens may cut it).
    res["grammar_sampled"] = [regex_sampled(url, p) for p in GRAMMAR_PROMPTS]
    sampled = {"temperature": 0.8, "top_p": 0.95, "max_new_tokens": 48, "ignore_eos": True}
    res["sampled"] = {k: v for k, v in timed(url, base.ALT[0], sampled, 15).items() if k in ("secs", "error")}
    return res


if __name__ == "__main__":
    main()
