"""`ddtree-deploy bench` on a sandbox host: results folder, lossless checks, baselines, and the host put back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from ddtree_deploy.benchmark.results import BenchResults
from tests.bench_cmd.conftest import LOSSY_FROM, MAX_BUDGET, bench_json, host_report, status_row

if TYPE_CHECKING:
    from tests.push.conftest import Fleet

PNG = b"\x89PNG\r\n\x1a\n"
QUICK = ("--no-tree-stats", "--seeds", "", "--max-new-tokens", "48", "--batch", "2")


def _png_opens(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG and len(data) > 2000, path
    try:
        from matplotlib import image
    except ImportError:
        return
    assert image.imread(str(path)).shape[0] > 100


def test_bench_writes_json_table_plots_and_leaves_the_host_as_it_was(fleet: Fleet, tmp_path: Path) -> None:
    before, digest = status_row(fleet), fleet.package_digest()
    folder = tmp_path / "results"
    code, envelope = fleet.json("bench", "--host", "ct200", "--budgets", "16,32,64", "--batch", "3",
                                "--seeds", "5", "--max-new-tokens", "64", "--results", str(folder))
    report = host_report(envelope)
    assert code == 0 and report["outcome"] == "ok", report
    assert [s["step"] for s in report["steps"]] == ["preflight", "snapshot", "bench", "relaunch", "probe"]

    results = BenchResults.model_validate(bench_json(folder))
    assert [v.variant for v in results.variants] == ["plain", "dflash", "ddtree@16", "ddtree@32", "ddtree@64"]
    assert results.block_size == 8 and results.sglang == "0.5.17" and results.batch == 3
    for v in results.variants:
        assert {(r.mode, r.batch) for r in v.runs} == {("greedy", 1), ("greedy", 3), ("sampled", 1), ("sampled", 3)}
        assert all(r.tokens_per_s > 0 and r.completion_tokens > 0 for r in v.runs)
    speculative = results.variants[1:]
    assert all(v.lossless and v.lossless.identical == v.lossless.compared == 16 for v in speculative)
    means = [v.acceptance.mean for v in speculative if v.acceptance]
    assert means == sorted(means) and len(set(means)) == 4, means  # DFLASH < 16 < 32 < 64: rising with budget
    for v in speculative:
        assert v.acceptance and len(v.acceptance.histogram) == 8 and abs(sum(v.acceptance.histogram) - 1) < 1e-9
    trees = [v.tree for v in speculative[1:]]
    assert [t.nodes_mean if t else None for t in trees] == [16, 32, 64]
    assert all(t and len(t.top1_agreement) == 7 and t.top1_agreement[0] is not None for t in trees)
    # the debug lines' rounds are the greedy batch-1 rounds: the two sources agree
    assert all(t and v.acceptance and t.accept_mean == pytest.approx(v.acceptance.per_round)
               for t, v in zip(trees, speculative[1:], strict=True))

    table = (folder / "bench.md").read_text()
    assert "| ddtree@64 |" in table and "P(tau = b)" in table
    files = envelope["data"]["files"]  # type: ignore[index]
    assert {Path(f).name for f in files} >= {"bench.json", "bench.md"}
    plots = [Path(f) for f in files if f.endswith(".png")]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not plots and "matplotlib" in envelope["data"]["plots_skipped"]  # type: ignore[index]
    else:
        assert {p.name for p in plots} == {"acceptance.png", "tokens_per_s.png"}
        for p in plots:
            _png_opens(p)

    after = status_row(fleet)
    assert after["launch_args"] == before["launch_args"] and after["overlay"] == before["overlay"]
    assert fleet.package_digest() == digest


def test_a_budget_the_server_cannot_start_rolls_back_and_keeps_the_partial_results(fleet: Fleet,
                                                                                  tmp_path: Path) -> None:
    before, digest = status_row(fleet), fleet.package_digest()
    folder = tmp_path / "partial"
    code, envelope = fleet.json("bench", "--host", "ct200", "--budgets", f"16,{MAX_BUDGET + 212}",
                                "--results", str(folder), *QUICK)
    report = host_report(envelope)
    assert code == 1 and report["outcome"] == "rolled_back" and report["failed_step"] == "bench", report
    assert "exited" in report["reason"] or "fatal" in report["reason"], report["reason"]
    assert [(s["step"], s["status"]) for s in report["recovery"]] == [("restore", "ok"), ("relaunch", "ok"),
                                                                      ("probe", "ok")]
    partial = BenchResults.model_validate(bench_json(folder))
    assert [v.variant for v in partial.variants] == ["plain", "dflash", "ddtree@16"]
    assert status_row(fleet)["launch_args"] == before["launch_args"] and fleet.package_digest() == digest


def test_a_lossy_budget_fails_the_bench_naming_it(fleet: Fleet, tmp_path: Path) -> None:
    before = status_row(fleet)
    code, envelope = fleet.json("bench", "--host", "ct200", "--budgets", f"16,{LOSSY_FROM}", "--no-dflash",
                                "--results", str(tmp_path), *QUICK)
    report = host_report(envelope)
    assert code == 1 and report["outcome"] == "rolled_back", report
    assert f"ddtree@{LOSSY_FROM} is not lossless: prompt 0 at batch 1 differs" in report["reason"]
    lossy = BenchResults.model_validate(bench_json(tmp_path)).variant(f"ddtree@{LOSSY_FROM}")
    assert lossy and lossy.lossless and lossy.lossless.identical == 0
    assert status_row(fleet)["launch_args"] == before["launch_args"]


def test_keep_going_measures_the_variants_after_a_lossy_one_and_still_fails(fleet: Fleet, tmp_path: Path) -> None:
    before = status_row(fleet)
    code, envelope = fleet.json("bench", "--host", "ct200", "--budgets", f"{LOSSY_FROM},16", "--no-dflash",
                                "--keep-going", "--results", str(tmp_path), *QUICK)
    report = host_report(envelope)
    assert code == 1 and report["outcome"] == "rolled_back", report
    assert report["reason"].startswith(f"ct200: ddtree@{LOSSY_FROM} is not lossless: prompt 0"), report["reason"]
    measured = BenchResults.model_validate(bench_json(tmp_path))
    assert [v.variant for v in measured.variants] == ["plain", f"ddtree@{LOSSY_FROM}", "ddtree@16"]
    after = measured.variant("ddtree@16")
    assert after and after.lossless and after.lossless.mismatch is None and after.runs
    assert status_row(fleet)["launch_args"] == before["launch_args"]


def test_baseline_gate_passes_on_the_same_numbers_and_fails_on_a_planted_regression(fleet: Fleet,
                                                                                   tmp_path: Path) -> None:
    first = tmp_path / "first"
    code, _ = fleet.json("bench", "--host", "ct200", "--budgets", "16,64", "--results", str(first), *QUICK)
    assert code == 0
    code, envelope = fleet.json("bench", "--host", "ct200", "--budgets", "16,64", "--results",
                                str(tmp_path / "again"), "--baseline", str(first / "bench.json"), *QUICK)
    comparison = envelope["data"]["comparison"]  # type: ignore[index]
    assert code == 0 and comparison["ok"], comparison
    assert {r["variant"]: r["accept_diff"] for r in comparison["rows"]} == {
        "dflash": 0.0, "ddtree@16": 0.0, "ddtree@64": 0.0}

    planted = bench_json(first)
    for variant in planted["variants"]:
        if variant["variant"] == "ddtree@64":
            for run in variant["runs"]:
                for request in run["requests"]:  # one accepted draft fewer in every round's count: tau - 1
                    request["accept_counts"] = request["accept_counts"][1:] + [0]
                if run["acceptance"]:
                    hist = run["acceptance"]["histogram"]
                    run["acceptance"].update(mean=run["acceptance"]["mean"] - 1, histogram=hist[1:] + [0.0])
    (tmp_path / "planted.json").write_text(json.dumps(planted))
    code, envelope = fleet.json("bench", "--host", "ct200", "--budgets", "16,64", "--results",
                                str(tmp_path / "third"), "--baseline", str(tmp_path / "planted.json"), *QUICK)
    comparison = envelope["data"]["comparison"]  # type: ignore[index]
    assert code == 1 and not comparison["ok"], comparison
    assert "ddtree@64 against" in comparison["message"] and "diff +1.000" in comparison["message"]
    assert "FAIL" in (tmp_path / "third" / "bench.md").read_text()


def test_bad_input_is_refused_before_the_host_is_touched(fleet: Fleet, tmp_path: Path) -> None:
    before = status_row(fleet)
    snapshots = fleet.json("snapshots", "--host", "ct200")[1]
    (tmp_path / "zlab.txt").write_text("Baseline throughput: 10 tok/s\n")
    for args, words in [(("--budgets", "16,x"), "--budgets '16,x'"),
                        (("--baseline", str(tmp_path / "missing.txt")), "missing.txt: cannot read"),
                        (("--baseline", str(tmp_path / "zlab.txt")), "expected one z-lab benchmark.py result"),
                        (("--batch", "0"), "--batch")]:
        proc = fleet.cli("bench", "--host", "ct200", "--results", str(tmp_path / "r"), *args)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert words in proc.stderr + proc.stdout, (args, proc.stderr)
    assert status_row(fleet)["server"] == before["server"]  # same pid: never restarted
    assert fleet.json("snapshots", "--host", "ct200")[1] == snapshots
