"""The bench's arithmetic and parsers, on SGLang-shaped answers, overlay debug lines and z-lab's printed text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddtree_deploy.benchmark import measure
from ddtree_deploy.benchmark.baseline import compare, parse_spec, read_baseline
from ddtree_deploy.benchmark.results import BenchResults, RequestStats, VariantResult, acceptance_of, total_variation
from ddtree_deploy.benchmark.sweep import Variant, without
from ddtree_deploy.errors import UsageError

# What z-lab's dflash benchmark.py prints through rich (dflash/benchmark.py, _print_decode_summary): a
# block size of 8 gives 9 bins, b = 0..8, and rich wraps the list at the console's width.
ZLAB = """\x1b[1mBaseline throughput: 41.20 tok/s\x1b[0m
DFlash throughput:  170.02 tok/s
Decoding speedup: 4.13
Average Acceptance length: 4.00
Acceptance length histogram: ['0.0%', '25.0%', '0.0%', '0.0%', '25.0%', '0.0%', '0.0%',
'0.0%', '50.0%']
"""


def test_request_stats_reads_sglang_meta_not_its_misleading_aggregates() -> None:
    # 0.5.17's meta_info for 10 rounds committing 1+2+2+3+3+3+4+4+4+4 = 30 tokens: the prefill's token is in
    # completion_tokens, so spec_accept_length (31 / 10) overstates the rounds' mean (3.0), and the rate
    # divides the 20 accepted drafts by budget 64 per round
    meta = {"completion_tokens": 31, "spec_verify_ct": 10, "spec_accept_length": 3.1, "spec_num_correct_drafts": 20,
            "spec_accept_rate": 20 / (10 * 64), "spec_correct_drafts_histogram": [1, 2, 3, 4, 0, 0]}
    stats = measure.request_stats({"output_ids": [1] * 31, "meta_info": meta}, 0)
    assert stats.accept_counts == [1, 2, 3, 4] and stats.rounds == 10
    assert stats.mean_accept == pytest.approx(3.0)
    # no histogram (an older server): the mean from the accepted drafts, no histogram
    meta.pop("spec_correct_drafts_histogram")
    fallback = measure.request_stats({"meta_info": meta}, 1)
    assert fallback.accept_counts == [] and fallback.mean_accept == pytest.approx(3.0)
    plain = measure.request_stats({"output_ids": [1, 2, 3], "meta_info": {"completion_tokens": 3}}, 2)
    assert plain.rounds == 0 and plain.mean_accept is None


def test_acceptance_is_zlabs_mean_of_request_means_and_the_pooled_histogram() -> None:
    short = RequestStats(prompt=0, completion_tokens=9, rounds=2, accept_counts=[0, 0, 0, 2])  # tau 4, 4
    long = RequestStats(prompt=1, completion_tokens=9, rounds=8, accept_counts=[8])  # tau 1 x 8
    got = acceptance_of([short, long], size=4)
    assert got is not None
    assert got.mean == pytest.approx((4 + 1) / 2) and got.per_round == pytest.approx(16 / 10)
    assert got.histogram == [0.8, 0.0, 0.0, 0.2] and got.rounds == 10
    assert total_variation([0.5, 0.5], [0.5, 0.25, 0.25]) == pytest.approx(0.25)


def test_debug_lines_give_tree_size_depth_and_top1_agreement_per_depth() -> None:
    lines = [
        '[2026-12-01 10:00:00 TP0] ddtree_debug {"rid": "a", "budget": 8, "tree_nodes": 8, "tree_depth": 3, '
        '"accepted_nodes": 2, "accept_length": 3, "draft_top1_agree": [1, 0, 0, -1]}',
        '[2026-12-01 10:00:00 TP0] ddtree_debug {"rid": "a", "budget": 8, "tree_nodes": 6, "tree_depth": 4, '
        '"accepted_nodes": 0, "accept_length": 1, "draft_top1_agree": [0, -1, -1, -1]}',
        '[2026-12-01 10:00:00 TP0] ddtree_debug {"rid": "other", "tree_nodes": 99}',
        "[2026-12-01 10:00:00 TP0] ddtree_debug {cut off",
        "INFO:     127.0.0.1 - POST /generate 200",
    ]
    records = measure.debug_records("\n".join(lines), ["a"])
    stats = measure.tree_stats(records)
    assert stats is not None and stats.rounds == 2
    assert stats.nodes_mean == 7 and stats.depth_mean == 3.5 and stats.depth_max == 4 and stats.accept_mean == 2
    assert stats.top1_agreement == [0.5, 0.0, 0.0, None]
    assert measure.tree_stats([]) is None


def test_the_overlays_real_debug_lines_parse_into_tree_stats() -> None:
    """Run 7's ddtree_debug records (0.2.1 on the H200, docs/gpu-runs/), as the server logs them."""
    path = Path(__file__).resolve().parents[2] / "docs/gpu-runs/run7-ddtree-debug.jsonl"
    raw = [json.loads(line) for line in path.read_text().splitlines()]
    log = "\n".join(f"[2026-11-20 10:00:00 TP0] ddtree_debug {json.dumps(r)}" for r in raw)
    rids = sorted({r["rid"] for r in raw})
    stats = measure.tree_stats(measure.debug_records(log, rids))
    assert stats is not None and stats.rounds == len(raw)
    assert stats.nodes_mean == pytest.approx(sum(r["tree_nodes"] for r in raw) / len(raw))
    assert stats.depth_max == max(r["tree_depth"] for r in raw)
    first = [r["draft_top1_agree"][0] for r in raw]
    assert stats.top1_agreement[0] == pytest.approx(sum(first) / len(first))


def test_variants_rewrite_the_found_args_keeping_the_rest() -> None:
    found = ["--attention-backend", "triton", "--speculative-algorithm", "DDTREE", "--speculative-ddtree-budget=64",
             "--speculative-dflash-block-size", "16", "--speculative-ddtree-debug"]
    assert Variant(None).server_args(found) == ["--attention-backend", "triton"]
    assert Variant("DFLASH").server_args(found) == ["--attention-backend", "triton", "--speculative-dflash-block-size",
                                                    "16", "--speculative-algorithm", "DFLASH"]
    assert Variant("DDTREE", 256, debug=True).server_args(found) == [
        "--attention-backend", "triton", "--speculative-dflash-block-size", "16", "--speculative-algorithm", "DDTREE",
        "--speculative-ddtree-budget", "256", "--speculative-ddtree-debug"]
    assert without(["--a", "1", "2", "--b", "--c=3"], lambda f: f == "--a") == ["--b", "--c=3"]


def _results(means: dict[str, tuple[float, list[float]]]) -> BenchResults:
    from ddtree_deploy.benchmark.results import Acceptance, RunResult

    variants = [VariantResult(variant=name, runs=[RunResult(
        mode="greedy", batch=1, temperature=0, requests=[], completion_tokens=1, elapsed_s=1, tokens_per_s=1,
        acceptance=Acceptance(mean=mean, per_round=mean, histogram=hist, rounds=4))]) for name, (mean, hist) in
        means.items()]
    return BenchResults(source="test", variants=variants)


def test_zlab_text_is_read_even_wrapped_and_coloured(tmp_path: Path) -> None:
    (tmp_path / "zlab.txt").write_text(ZLAB)
    base = read_baseline(f"{tmp_path / 'zlab.txt'}")
    assert base.source == "z-lab benchmark.py" and list(base.acceptance) == ["dflash"]
    assert base.acceptance["dflash"].mean == 4.0
    assert base.acceptance["dflash"].histogram == [0.25, 0.0, 0.0, 0.25, 0.0, 0.0, 0.0, 0.5]
    assert list(read_baseline(f"{tmp_path / 'zlab.txt'}=64").acceptance) == ["ddtree@64"]
    assert parse_spec("a=b.txt=DFLASH") == (Path("a=b.txt"), "dflash")

    hist = [0.25, 0.0, 0.0, 0.25, 0.0, 0.0, 0.0, 0.5]
    same = compare(_results({"dflash": (4.0, hist)}), [base], max_accept_diff=0.05, max_tv=0.02)
    assert same.ok and same.rows[0].tv == 0.0
    regressed = compare(_results({"dflash": (3.5, [0.5, 0, 0, 0.25, 0, 0, 0, 0.25])}), [base], 0.05, 0.02)
    assert not regressed.ok and "diff -0.500" in regressed.message and "TV 0.250 > 0.02" in regressed.message
    unmeasured = compare(_results({"ddtree@16": (4.0, hist)}), [base], 0.05, 0.02)
    assert not unmeasured.ok and unmeasured.message.startswith("no baseline variant was measured")


def test_a_bench_json_baseline_names_its_variants_and_bad_files_are_one_line_errors(tmp_path: Path) -> None:
    path = tmp_path / "earlier.json"
    path.write_text(_results({"dflash": (3.0, [1.0]), "ddtree@64": (5.0, [0.0, 1.0])}).model_dump_json(by_alias=True))
    assert sorted(read_baseline(str(path)).acceptance) == ["ddtree@64", "dflash"]
    assert list(read_baseline(f"{path}=64").acceptance) == ["ddtree@64"]
    (tmp_path / "bad.json").write_text(json.dumps({"schema": "x", "variants": "no"}))
    for spec, words in [(str(tmp_path / "bad.json"), "not a bench JSON (field source"),
                        (f"{path}=ddtree@7", "no variant with acceptance numbers named ddtree@7"),
                        (str(tmp_path / "none.txt"), "cannot read the baseline")]:
        with pytest.raises(UsageError) as err:
            read_baseline(spec)
        assert words in str(err.value) and "\n" not in str(err.value)
