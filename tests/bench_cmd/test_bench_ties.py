"""`bench` on a host whose speculative decoding parts from plain at near-ties, as bf16 servers do."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddtree_deploy.benchmark.results import BenchResults
from tests.bench_cmd.conftest import bench_json, host_report, status_row
from tests.push.conftest import Fleet, started_fleet

GAP = 0.3  # the stand-in's speculative servers take plain's runner-up wherever it is within this many nats
QUICK = ("--budgets", "16", "--no-tree-stats", "--seeds", "", "--max-new-tokens", "48", "--batch", "2")


@pytest.fixture(scope="module")
def tie_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    fleets = started_fleet(tmp_path_factory.mktemp("tie-fleet"), ("ct200",), ready_timeout_s=20.0,
                           extra_args=["--standin-tie-flips", str(GAP)])
    the_fleet = next(fleets)
    pushed = the_fleet.cli("push", "--host", "ct200")  # the push's own lossless probe passes the ties too
    assert pushed.returncode == 0, pushed.stdout + pushed.stderr
    yield the_fleet
    next(fleets, None)


def test_near_tie_splits_pass_and_are_listed_with_their_gaps(tie_fleet: Fleet, tmp_path: Path) -> None:
    code, envelope = tie_fleet.json("bench", "--host", "ct200", *QUICK, "--results", str(tmp_path))
    assert code == 0 and host_report(envelope)["outcome"] == "ok", envelope
    results = BenchResults.model_validate(bench_json(tmp_path))
    for variant in results.variants[1:]:
        lossless = variant.lossless
        assert lossless and lossless.compared == 16 and lossless.mismatch is None
        assert lossless.near_ties and lossless.identical + len(lossless.near_ties) == 16
        assert all(0 <= t.gap <= GAP and t.batch in (1, 2) for t in lossless.near_ties)
    assert "near-tie)" in (tmp_path / "bench.md").read_text()


def test_tolerance_zero_fails_the_bench_at_the_first_split_and_puts_the_host_back(tie_fleet: Fleet,
                                                                                   tmp_path: Path) -> None:
    before, digest = status_row(tie_fleet), tie_fleet.package_digest()
    code, envelope = tie_fleet.json("bench", "--host", "ct200", *QUICK, "--tie-tolerance", "0",
                                    "--results", str(tmp_path))
    report = host_report(envelope)
    assert code == 1 and report["outcome"] == "rolled_back", report
    assert "dflash is not lossless" in report["reason"] and "gap" in report["reason"], report["reason"]
    after = status_row(tie_fleet)
    assert tie_fleet.package_digest() == digest and after["launch_args"] == before["launch_args"]


def test_a_bench_killed_mid_way_keeps_the_variants_it_had_measured(tie_fleet: Fleet, tmp_path: Path) -> None:
    # last in this module: the killed bench leaves its lock and a variant's server behind
    argv = [sys.executable, "-m", "ddtree_deploy.cli", "bench", "--host", "ct200", *QUICK, "--results", str(tmp_path)]
    bench = subprocess.Popen(argv, env=tie_fleet.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kept = tmp_path / "bench.json"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and bench.poll() is None:
        if kept.exists() and len(json.loads(kept.read_text())["variants"]) >= 2:
            break
        time.sleep(0.05)
    bench.kill()
    assert bench.wait() == -9, "the bench ended before two variants were kept"
    results = BenchResults.model_validate(bench_json(tmp_path))
    assert [v.variant for v in results.variants][:2] == ["plain", "dflash"]
    assert all(v.runs for v in results.variants)
    assert not (tmp_path / "bench.md").exists()  # the file is the sweep's own, not the command's last word
