#!/usr/bin/env python3
"""Where a sampled case parts from plain: per prompt, the most common context before one position,
the target's fp32 distribution there, and how far its cumulative sums sit from the cut.

usage: sample_contexts.py MODEL_DIR SETTING POSITION REF.json CASE.json [CASE.json...]

Runs on the CPU with transformers (the target of make_models.py, rebuilt from its seeds, is the
GPU run's target bit for bit in fp32). POSITION counts from 1, as sample_compare.py prints it. For
each prompt: its most common context (the tokens drawn before POSITION), the top three tokens'
shares of the distribution at the setting's temperature, the mass above each of them against
top_p (a mass within a few thousandths of top_p is a near-tie at the cut, which the verify's and
the decode's bf16 logits may fall on either side of), and how often each file drew each of the
three there.
"""
from __future__ import annotations

import json
import sys
from collections import Counter

import torch

TOP = 3


def masses_above(shares: list[float]) -> list[float]:
    """The probability of the tokens ranked above each one: what top_p is compared with."""
    out, total = [], 0.0
    for share in shares:
        out.append(total)
        total += share
    return out


def most_common_contexts(samples: list[dict], position: int) -> dict[str, tuple[int, ...]]:
    """Per prompt (its JSON), the tokens most often drawn before 1-based `position`."""
    counts: dict[str, Counter] = {}
    for s in samples:
        counts.setdefault(json.dumps(s["prompt"]), Counter())[tuple(s["output_ids"][:position - 1])] += 1
    return {prompt: c.most_common(1)[0][0] for prompt, c in counts.items()}


def draws_at(samples: list[dict], prompt: str, context: tuple[int, ...], tokens: list[int]) -> list[int]:
    """How often each of `tokens` (then any other) was drawn after `context` for `prompt`."""
    counts = [0] * (len(tokens) + 1)
    for s in samples:
        if json.dumps(s["prompt"]) == prompt and tuple(s["output_ids"][:len(context)]) == context:
            token = s["output_ids"][len(context)]
            counts[tokens.index(token) if token in tokens else len(tokens)] += 1
    return counts


def main() -> None:
    from transformers import AutoModelForCausalLM

    model_dir, setting, position = sys.argv[1], sys.argv[2], int(sys.argv[3])
    runs = {path: json.load(open(path)) for path in sys.argv[4:]}
    ref = next(iter(runs.values()))
    params = ref["settings"][setting]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for prompt, context in most_common_contexts(ref["samples"][setting], position).items():
        with torch.no_grad():
            logits = model(torch.tensor([json.loads(prompt) + list(context)])).logits[0, -1]
        probs = torch.softmax(logits / params["temperature"], dim=-1)
        shares, tokens = (t.tolist() for t in probs.topk(TOP))
        above = masses_above(shares)
        print(f"prompt {prompt} context {list(context)}: top {tokens} shares {[round(x, 4) for x in shares]}"
              f" mass above {[round(x, 4) for x in above]} (top_p {params.get('top_p', 1.0)})")
        for path, run in runs.items():
            print(f"  {path}: draws {draws_at(run['samples'][setting], prompt, context, tokens)}")


if __name__ == "__main__":
    main()
