#!/usr/bin/env python3
"""Stress one running SGLang server the way real traffic does (issue 17, "Correctness under real
traffic"): 40 greedy requests on the copy pair's token ids, arriving staggered while others decode
(the server is started with --max-running-requests 4: batches up to the graph maximum, and a
finished request's req_to_token row is the very next one handed out), short prompts first and
prompts up to 700 tokens later, max_new_tokens from 1 to 150, a quarter ending on a stop string and
some on a stop token id (both finish a request inside an accepted run). Under the overlap scheduler
a finished request still rides one more round while its row goes to the next request.

usage: stress_client.py PORT OUT_JSON LABEL [REF_JSON]

Without REF_JSON (the plain server) it plans the requests, taking the stop strings and stop token
ids from this server's own greedy outputs, and records plan and outputs. With REF_JSON it replays
that plan and compares every output (token ids, text, finish reason) with the reference's.
Either way it checks the allocator: /v1/loads' num_used_tokens (KV pool size minus free minus
evictable slots) must be back at its value from before the stress once the server has drained
and gone idle (SGLang then also runs its own leak check, which raises on a mismatch), again after
/flush_cache, and /health must still answer. A double free that cancels a leak keeps the count;
the output comparison (slots shared by two requests) and the _check case's
SGLANG_CHECK_KV_PAGE_INVARIANTS (duplicate free pages) catch it. Prints STRESS[...] lines.
"""
from __future__ import annotations

import json
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import requests

N = 40
MAX_NEW = [1, 2, 3, 4, 7, 12, 20, 33, 64, 100, 150]


def prompt_ids(rng: random.Random, length: int) -> list[int]:
    """Copy-pair ids: an alternating pair from [256, 512) (the tree's case), a repeated token from
    [0, 256) (the chain's), or a repeated prefix then an alternating tail."""
    kind = rng.choice(("alt", "rep", "mixed"))
    a = 256 + 2 * rng.randrange(120)
    alt = [a, a + 1] * (length // 2 + 1)
    rep = [rng.randrange(5, 250)] * length
    if kind == "alt":
        return alt[:length]
    if kind == "rep":
        return rep
    cut = rng.randrange(1, length) if length > 1 else 1
    return (rep[:cut] + alt)[:length]


def plan_requests() -> list[dict]:
    """Deterministic: prompts, max_new_tokens and arrival times (seconds from the start)."""
    rng = random.Random(17)
    reqs, t = [], 0.0
    for i in range(N):
        long_ok = i >= N // 4  # short ones first: their rows go to longer prompts later
        length = rng.choice([4, 6, 9, 16] + ([120, 300, 500, 700] if long_ok else []))
        t += rng.choice([0.0, 0.0, 0.01, 0.03, 0.06, 0.1])  # bursts and gaps while others decode
        reqs.append({"input_ids": prompt_ids(rng, length), "max_new_tokens": rng.choice(MAX_NEW),
                     "at": round(t, 3), "stop": None, "stop_token_ids": None})
    return reqs


def post(url: str, req: dict) -> dict:
    sp = {"temperature": 0.0, "max_new_tokens": req["max_new_tokens"], "ignore_eos": True}
    if req["stop"]:
        sp["stop"] = req["stop"]
    if req["stop_token_ids"]:
        sp["stop_token_ids"] = req["stop_token_ids"]
    r = requests.post(url + "/generate", json={"input_ids": req["input_ids"], "sampling_params": sp}, timeout=300)
    r.raise_for_status()
    return r.json()


def add_stops(url: str, reqs: list[dict]) -> None:
    """A stop string from the middle of every 4th request's greedy text, a stop token id from a
    third into every 6th request's output: both end a request before max_new_tokens."""
    for i, req in enumerate(reqs):
        string, token = i % 4 == 1, i % 6 == 4
        if req["max_new_tokens"] < 7 or not (string or token):
            continue
        x = post(url, req)
        ids, text = x["output_ids"], x["text"]
        middle = text[len(text) // 2 : len(text) // 2 + 3]
        if string and middle.strip():
            req["stop"] = [middle]
        if token and len(ids) >= 6:
            req["stop_token_ids"] = [ids[len(ids) // 3]]


def loads(url: str) -> dict:
    return requests.get(url + "/v1/loads", params={"include": "core"}, timeout=30).json()["loads"][0]


def settled_used(url: str, timeout: float = 30.0) -> int:
    """num_used_tokens once nothing runs or waits and the count holds still for a second."""
    deadline, last = time.time() + timeout, None
    while time.time() < deadline:
        x = loads(url)
        if x["num_running_reqs"] == 0 and x["num_waiting_reqs"] == 0:
            if last == x["num_used_tokens"]:
                return last
            last = x["num_used_tokens"]
        time.sleep(1.0)
    raise RuntimeError(f"server did not settle within {timeout}s: {loads(url)}")


def run(url: str, reqs: list[dict]) -> tuple[list[dict], float]:
    start = time.perf_counter()

    def one(req: dict) -> dict:
        time.sleep(max(0.0, start + req["at"] - time.perf_counter()))
        x = post(url, req)
        return {"output_ids": x["output_ids"], "text": x["text"],
                "finish_reason": x["meta_info"].get("finish_reason"),
                "completion_tokens": x["meta_info"].get("completion_tokens"),
                "spec_accept_length": x["meta_info"].get("spec_accept_length")}

    with ThreadPoolExecutor(max_workers=len(reqs)) as pool:
        outs = list(pool.map(one, reqs))
    return outs, time.perf_counter() - start


def compare(ref: list[dict], outs: list[dict], reqs: list[dict]) -> int:
    same = 0
    for i, (a, b) in enumerate(zip(ref, outs, strict=True)):
        keys = ("output_ids", "text", "finish_reason")
        if all(a[k] == b[k] for k in keys):
            same += 1
            continue
        x, y = a["output_ids"], b["output_ids"]
        first = next((j for j, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), min(len(x), len(y)))
        print(f"  request {i}: prompt {len(reqs[i]['input_ids'])} tokens, max_new {reqs[i]['max_new_tokens']}, "
              f"stop {reqs[i]['stop']} {reqs[i]['stop_token_ids']}: lengths {len(x)} vs {len(y)}, first diff "
              f"at {first}, finish {a['finish_reason']} vs {b['finish_reason']}")
    return same


def main() -> None:
    port, out, label = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    ref = json.load(open(sys.argv[4])) if len(sys.argv) > 4 else None
    url = f"http://127.0.0.1:{port}"
    post(url, {"input_ids": [100, 200, 300, 900], "max_new_tokens": 16, "stop": None, "stop_token_ids": None})
    if ref is None:
        reqs = plan_requests()
        add_stops(url, reqs)
    else:
        reqs = ref["requests"]
    used_before = settled_used(url)
    outs, secs = run(url, reqs)
    used_after = settled_used(url)
    requests.post(url + "/flush_cache", timeout=60)
    used_flushed = settled_used(url)
    healthy = requests.get(url + "/health", timeout=30).status_code == 200
    res = {"requests": reqs, "outputs": outs, "secs": round(secs, 3), "used_tokens": {
        "before": used_before, "after_drain": used_after, "after_flush": used_flushed}, "healthy": healthy}
    json.dump(res, open(out, "w"), indent=1)
    tokens = sum(o["completion_tokens"] or 0 for o in outs)
    stopped = sum(o["finish_reason"] is not None and o["finish_reason"].get("type") == "stop" for o in outs)
    print(f"STRESS[{label}] {len(outs)} requests, {tokens} tokens in {secs:.1f}s, {stopped} ended on a stop")
    ok_pool = used_before == used_after == used_flushed
    print(f"STRESS_POOL[{label}] num_used_tokens before {used_before}, after drain {used_after}, after flush "
          f"{used_flushed}, healthy {healthy} ->", "YES" if ok_pool and healthy else "NO")
    if ref is not None:
        same = compare(ref["outputs"], outs, reqs)
        print(f"STRESS_MATCH[{label}] {same}/{len(outs)} identical to the reference ->",
              "YES" if same == len(outs) else "NO")


if __name__ == "__main__":
    main()
