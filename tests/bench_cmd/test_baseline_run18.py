"""The `--baseline` gate on real numbers: run 18's GPU sweep of the trained pair (docs/gpu-runs/).

The team's use after a push: hold the new sweep against the last good one. The sweep held against
itself passes; the same sweep with a planted regression (DDTREE@256 accepting what DDTREE@16
accepts, a lost budget) fails, naming the variant and the numbers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddtree_deploy.benchmark.baseline import compare, read_baseline
from ddtree_deploy.benchmark.results import BenchResults

RUN18 = Path(__file__).resolve().parents[2] / "docs/gpu-runs/run18-rc5-sweep/bench.json"


@pytest.fixture(scope="module")
def sweep() -> BenchResults:
    return BenchResults.model_validate_json(RUN18.read_text())


def test_the_real_sweep_passes_against_itself(sweep: BenchResults) -> None:
    gate = compare(sweep, [read_baseline(str(RUN18))], max_accept_diff=0.1, max_tv=0.05)
    assert gate.ok, gate.message
    assert {r.variant for r in gate.rows if r.measured} == {"dflash", "ddtree@16", "ddtree@64", "ddtree@256",
                                                             "ddtree@1024"}
    # the shape the paper reports: acceptance rises with the budget, every tree above the chain
    means = [sweep.variant(v).acceptance.mean for v in ("dflash", "ddtree@16", "ddtree@64", "ddtree@256",
                                                         "ddtree@1024")]
    assert means == sorted(means) and means[0] < means[1]


def test_a_planted_regression_fails_the_gate_naming_the_variant(sweep: BenchResults, tmp_path: Path) -> None:
    data = json.loads(RUN18.read_text())
    by_name = {v["variant"]: v for v in data["variants"]}
    by_name["ddtree@256"]["runs"] = by_name["ddtree@16"]["runs"]  # the 256-node tree now accepts like 16 nodes
    regressed = BenchResults.model_validate(data)
    gate = compare(regressed, [read_baseline(str(RUN18))], max_accept_diff=0.1, max_tv=0.05)
    assert not gate.ok
    (failed,) = [r for r in gate.rows if not r.ok]
    assert failed.variant == "ddtree@256" and failed.accept_diff == pytest.approx(2.80 - 3.35, abs=0.01)
    assert "ddtree@256" in gate.message and "mean acceptance" in gate.message
