#!/usr/bin/env python3
"""Compare the sampled continuations of a case with the plain case's, position by position, by the
rank each drawn token has in the target's own top three there (a chi-square homogeneity test).

usage: sample_compare.py REF.json CASE.json LABEL REF_PORT

The ranks come from the still-running plain server: one prefill of prompt + continuation with
`return_logprob` and the top three log-probs at every input position, and the row is checked to
line up (the logprob entry at each position names the token that is there). A lossless rule draws
the same distribution of ranks as plain sampling at every position; a rule that keeps fewer tokens
than plain's (SGLang's DFLASH verify under top_k with top_p) draws rank 3 less often or never.
Prints, per setting and position, the rank counts and the test, then SAMPLE_MATCH[LABEL] lines.
"""
from __future__ import annotations

import json
import sys
import urllib.request

import torch

TOP, ALPHA, BATCH, RARE = 3, 0.001, 100, 10


def rank_of(token: int, top_ids: list[int]) -> int:
    """0..TOP-1 for a token among the target's top three, TOP for any other token."""
    return top_ids.index(token) if token in top_ids else TOP


def rank_counts(ranks_per_sample: list[list[int]]) -> list[list[int]]:
    """counts[position][rank] over all samples."""
    positions = len(ranks_per_sample[0])
    counts = [[0] * (TOP + 1) for _ in range(positions)]
    for ranks in ranks_per_sample:
        for pos, r in enumerate(ranks):
            counts[pos][r] += 1
    return counts


def pooled(a: list[int], b: list[int]) -> list[tuple[int, int]]:
    """The cells of two count vectors, those with fewer than RARE draws in both samples together
    pooled into one (the chi-square approximation needs expected counts of about 5 or more);
    cells empty in both are dropped."""
    cells = [(x, y) for x, y in zip(a, b, strict=True) if x + y >= RARE]
    rare = [(x, y) for x, y in zip(a, b, strict=True) if 0 < x + y < RARE]
    if rare:
        cells.append((sum(x for x, _ in rare), sum(y for _, y in rare)))
    return cells


def chi_square(a: list[int], b: list[int]) -> tuple[float, int, float]:
    """Two-sample chi-square homogeneity test on count vectors: (statistic, dof, p-value)."""
    cells = pooled(a, b)
    na, nb = sum(a), sum(b)
    stat = 0.0
    for x, y in cells:
        total = x + y
        for observed, n in ((x, na), (y, nb)):
            expected = total * n / (na + nb)
            stat += (observed - expected) ** 2 / expected
    dof = max(len(cells) - 1, 1)
    p = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                      torch.tensor(stat / 2, dtype=torch.float64)))
    return stat, dof, p


def ranks_from_server(port: int, samples: list[dict]) -> list[list[int]]:
    """The rank of every continuation token in the plain server's top three at its position."""
    out: list[list[int]] = []
    for start in range(0, len(samples), BATCH):
        chunk = samples[start:start + BATCH]
        body = {"input_ids": [s["prompt"] + s["output_ids"] for s in chunk], "return_logprob": True,
                "logprob_start_len": 0, "top_logprobs_num": TOP,
                "sampling_params": {"temperature": 0.0, "max_new_tokens": 1}}
        request = urllib.request.Request(f"http://127.0.0.1:{port}/generate", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as r:  # an HTTP error raises
            rows = json.load(r)
        for s, x in zip(chunk, rows, strict=True):
            ids = s["prompt"] + s["output_ids"]
            lps, tops = x["meta_info"]["input_token_logprobs"], x["meta_info"]["input_top_logprobs"]
            ranks = []
            for k in range(len(s["prompt"]), len(ids)):
                if lps[k][1] != ids[k]:
                    raise SystemExit(f"logprob row misaligned at {k}: {lps[k][1]} != {ids[k]}")
                ranks.append(rank_of(ids[k], [t for _, t, *_ in tops[k]]))
            out.append(ranks)
    return out


def by_prompt(samples: list[dict], ranks: list[list[int]], pos: int) -> dict[str, list[int]]:
    """Rank counts at one position, per prompt: a rule that parts from plain's only where one
    context's cumulative probability sits at top_p (a near-tie at the cut) shows in one prompt."""
    out: dict[str, list[int]] = {}
    for sample, r in zip(samples, ranks, strict=True):
        counts = out.setdefault(str(sample["prompt"]), [0] * (TOP + 1))
        counts[r[pos]] += 1
    return out


def main() -> None:
    ref, case = (json.load(open(f)) for f in sys.argv[1:3])
    label, port = sys.argv[3], int(sys.argv[4])
    for setting in ref["samples"]:
        ref_ranks = ranks_from_server(port, ref["samples"][setting])
        case_ranks = ranks_from_server(port, case["samples"][setting])
        a, b = rank_counts(ref_ranks), rank_counts(case_ranks)
        worst = 1.0
        for pos, (ca, cb) in enumerate(zip(a, b, strict=True)):
            stat, dof, p = chi_square(ca, cb)
            worst = min(worst, p)
            print(f"  {setting:9s} position {pos + 1}: plain ranks {ca}  case ranks {cb}  chi2 {stat:.2f} dof {dof} p {p:.3g}")
            if p < ALPHA:
                plain_by, case_by = by_prompt(ref["samples"][setting], ref_ranks, pos), by_prompt(
                    case["samples"][setting], case_ranks, pos)
                for prompt, counts in plain_by.items():
                    print(f"    prompt {prompt}: plain {counts}  case {case_by.get(prompt)}")
        verdict = "YES" if worst >= ALPHA else "NO"
        print(f"SAMPLE_MATCH[{label} {setting}] min p {worst:.3g} over {len(a)} positions -> {verdict}")


if __name__ == "__main__":
    main()
