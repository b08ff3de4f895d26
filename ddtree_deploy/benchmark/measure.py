"""Reading SGLang's answers and the DDTree overlay's debug lines into the bench's results.

Acceptance comes from each request's `meta_info`, never from SGLang's aggregate fields, which
mislead for DDTree (0.5.17, `tokenizer_manager._calculate_spec_decoding_metrics`): its
`spec_accept_rate` divides the accepted drafts by `spec_verify_ct * (speculative_num_draft_tokens - 1)`,
and DDTree's verify width is the budget + 1, so the rate falls with the budget; its
`spec_accept_length` is `completion_tokens / spec_verify_ct`, and `completion_tokens` counts the
token the prefill produced, which no round committed. What is read instead, in this order:

1. `spec_correct_drafts_histogram` (alias `spec_accept_histogram`): entry k counts the rounds that
   accepted k drafts, so tau = k + 1 (the bonus token) and the list is the request's
   `accept_counts` as is. SGLang fills it from the worker's `accept_lens` (`num_correct_drafts =
   accept_len - 1`, scheduler `batch_result_processor`), which DDTree's worker sets to its commit
   lengths, so it is exact for DDTREE and DFLASH alike.
2. Without it, `spec_num_correct_drafts` over `spec_verify_ct` gives the mean (no histogram).

Tree size, depth and the draft's top-1 agreement per depth exist only in the overlay's
`ddtree_debug {json}` log lines (`--speculative-ddtree-debug`, one per request and round: `rid`,
`budget`, `tree_nodes`, `tree_depth`, `accepted_nodes`, `accept_length`, `draft_top1_agree` with
1 / 0 / -1 per depth, ddtree_worker_v2.py `_log_debug`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from ddtree_deploy.benchmark.results import Mode, RequestStats, RunResult, TreeStats, acceptance_of

DEBUG_MARK = "ddtree_debug "


def request_stats(item: dict[str, Any], prompt: int, *, seed: int | None = None,
                  elapsed_s: float | None = None) -> RequestStats:
    """One `/generate` answer (a dict with `output_ids` and `meta_info`) as `RequestStats`."""
    meta = item.get("meta_info") or {}
    completion = int(meta.get("completion_tokens") or len(item.get("output_ids") or []))
    rounds = int(meta.get("spec_verify_ct") or 0)
    histogram = meta.get("spec_correct_drafts_histogram") or meta.get("spec_accept_histogram") or []
    counts = [int(c) for c in histogram] if rounds else []
    accepted = meta.get("spec_num_correct_drafts")
    return RequestStats(prompt=prompt, seed=seed, completion_tokens=completion, rounds=rounds,
                        accept_counts=_trimmed(counts),
                        accepted=int(accepted) if accepted is not None and rounds and not counts else None,
                        elapsed_s=elapsed_s)


def _trimmed(counts: list[int]) -> list[int]:
    while counts and counts[-1] == 0:
        counts = counts[:-1]
    return counts


def run_result(mode: Mode, batch: int, temperature: float, batches: list[tuple[float, list[RequestStats]]],
               block_size: int | None) -> RunResult:
    """Aggregate a pass: `batches` holds each `/generate` call's host-side elapsed time and requests."""
    requests = [r for _, group in batches for r in group]
    elapsed = sum(t for t, _ in batches)
    tokens = sum(r.completion_tokens for r in requests)
    per_round = [t / steps for t, group in batches if (steps := _steps(group))]
    return RunResult(mode=mode, batch=batch, temperature=temperature, requests=requests, completion_tokens=tokens,
                     elapsed_s=elapsed, tokens_per_s=tokens / elapsed if elapsed > 0 else 0.0,
                     round_time_ms=1000 * sum(per_round) / len(per_round) if per_round else None,
                     acceptance=acceptance_of(requests, block_size))


def _steps(group: list[RequestStats]) -> int:
    """Forward steps of a batch: its longest request's rounds (one per token for plain decoding)."""
    return max((r.rounds or r.completion_tokens for r in group), default=0)


def debug_records(log_text: str, rids: Iterable[str]) -> list[dict[str, Any]]:
    """The `ddtree_debug` records of these request ids, in log order (other lines and rids ignored)."""
    wanted = set(rids)
    records = []
    for line in log_text.splitlines():
        _, mark, payload = line.partition(DEBUG_MARK)
        if not mark:
            continue
        try:
            record = json.loads(payload)
        except ValueError:
            continue  # a line cut by the log's rotation or another writer
        if isinstance(record, dict) and record.get("rid") in wanted:
            records.append(record)
    return records


def tree_stats(records: list[dict[str, Any]]) -> TreeStats | None:
    """Tree size, depth, acceptance and per-depth top-1 agreement over the logged rounds."""
    if not records:
        return None
    depths = max(len(r.get("draft_top1_agree") or []) for r in records)
    agree: list[float | None] = []
    for d in range(depths):
        known = [r["draft_top1_agree"][d] for r in records
                 if d < len(r.get("draft_top1_agree") or []) and r["draft_top1_agree"][d] >= 0]
        agree.append(sum(known) / len(known) if known else None)
    n = len(records)
    return TreeStats(rounds=n, nodes_mean=sum(int(r["tree_nodes"]) for r in records) / n,
                     depth_mean=sum(int(r["tree_depth"]) for r in records) / n,
                     depth_max=max(int(r["tree_depth"]) for r in records), top1_agreement=agree,
                     accept_mean=sum(int(r["accept_length"]) for r in records) / n)
