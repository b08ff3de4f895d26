"""The bench's markdown table (bench.md): one row per variant, the histograms, and any baseline comparison."""

from __future__ import annotations

from ddtree_deploy.benchmark.baseline import Comparison
from ddtree_deploy.benchmark.results import BenchResults, VariantResult


def _num(value: float | None, fmt: str = ".2f") -> str:
    return "-" if value is None else format(value, fmt)


def markdown(results: BenchResults, comparison: Comparison | None = None) -> str:
    batch = results.batch or 1
    lines = [f"# Bench: {results.host or results.source}", "",
             f"{results.source}, {results.created_at or 'time unknown'}; sglang {results.sglang or '?'}, "
             f"model {results.model or '?'}; {len(results.prompts)} prompts x {results.max_new_tokens} tokens "
             f"(greedy; ignore_eos), block size S = {results.block_size or '?'}.",
             "Acceptance length tau = accepted drafts + the bonus token (mean over requests, z-lab's average).", ""]
    plain = results.variant("plain")
    plain_run = plain.run("greedy", 1) if plain else None
    base_tps = plain_run.tokens_per_s if plain_run else None
    head = ["variant", "accept mean", "per round", "rounds", "tok/s b1", f"tok/s b{batch}", "round ms b1",
            "speedup b1", "sampled accept", "tree nodes", "depth mean/max", "top-1 d1", "lossless"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(_row(v, batch, base_tps)) + " |" for v in results.variants]
    lines += ["", *_histograms(results)]
    if comparison is not None:
        lines += ["", *_comparison(comparison)]
    return "\n".join(lines) + "\n"


def _row(v: VariantResult, batch: int, base_tps: float | None) -> list[str]:
    b1, bn, sampled = v.run("greedy", 1), v.run("greedy", batch), v.run("sampled", 1)
    a = v.acceptance
    speedup = b1.tokens_per_s / base_tps if b1 and base_tps else None
    tree = v.tree
    lossless = "-" if v.lossless is None else f"{v.lossless.identical}/{v.lossless.compared}" + (
        f" (+{len(v.lossless.near_ties)} near-tie)" if v.lossless.near_ties else "")
    return [v.variant, _num(a.mean if a else None), _num(a.per_round if a else None), str(a.rounds) if a else "-",
            _num(b1.tokens_per_s if b1 else None, ".1f"), _num(bn.tokens_per_s if bn else None, ".1f"),
            _num(b1.round_time_ms if b1 else None, ".3f"), _num(speedup) + ("x" if speedup else ""),
            _num(sampled.acceptance.mean if sampled and sampled.acceptance else None),
            _num(tree.nodes_mean if tree else None, ".1f"),
            f"{tree.depth_mean:.2f}/{tree.depth_max}" if tree else "-",
            _num(tree.top1_agreement[0] if tree and tree.top1_agreement else None), lossless]


def _histograms(results: BenchResults) -> list[str]:
    rows = [(v.variant, v.acceptance.histogram) for v in results.variants if v.acceptance and v.acceptance.histogram]
    if not rows:
        return []
    width = max(len(h) for _, h in rows)
    lines = ["## P(tau = b), greedy, batch 1", "", "| variant | " + " | ".join(f"b={b}" for b in range(1, width + 1))
             + " |", "|" + "---|" * (width + 1)]
    for name, hist in rows:
        cells = [f"{100 * hist[b]:.1f}%" if b < len(hist) else "0.0%" for b in range(width)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _comparison(comparison: Comparison) -> list[str]:
    lines = [f"## Against the baseline (|diff| <= {comparison.max_accept_diff}, TV <= {comparison.max_tv}): "
             f"{'pass' if comparison.ok else 'FAIL'}", "",
             "| baseline | variant | ours | theirs | diff | TV | differing greedy requests | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    for r in comparison.rows:
        verdict = "not measured" if not r.measured else ("ok" if r.ok else "FAIL")
        lines.append(f"| {r.baseline} | {r.variant} | {_num(r.ours, '.3f')} | {r.theirs:.3f} | "
                     f"{_num(r.accept_diff, '+.3f')} | {_num(r.tv, '.3f')} | "
                     f"{', '.join(map(str, r.differing_requests)) or '-'} | {verdict} |")
    return lines
