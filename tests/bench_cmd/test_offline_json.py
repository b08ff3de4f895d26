"""The offline decode tool (CPU, tiny Qwen3 pair) writes the bench's JSON, which `--baseline` reads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ddtree_deploy.benchmark.baseline import compare, read_baseline
from ddtree_deploy.benchmark.results import BenchResults

pytest.importorskip("transformers")
TOOL = Path(__file__).resolve().parents[2] / "overlays" / "ddtree" / "tools" / "ddtree_cpu_decode.py"


def test_offline_decode_json_is_a_bench_baseline(tmp_path: Path) -> None:
    path = tmp_path / "offline.json"
    done = subprocess.run([sys.executable, str(TOOL), "--json", str(path), "--pair", "copy", "--budgets", "4,16",
                           "--max-new-tokens", "24"], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    results = BenchResults.model_validate(json.loads(path.read_text()))
    assert results.source == "ddtree_cpu_decode" and results.block_size == 8
    assert [v.variant for v in results.variants] == ["dflash", "ddtree@4", "ddtree@16"]
    assert all(isinstance(p, list) for p in results.prompts)  # token-id prompts: a server bench can send them
    for v in results.variants:
        run = v.run("greedy", 1)
        assert run and run.acceptance and len(run.requests) == len(results.prompts)
        assert len(run.acceptance.histogram) == 8 and abs(sum(run.acceptance.histogram) - 1) < 1e-9
        assert all(sum(r.accept_counts) == r.rounds > 0 for r in run.requests)

    baseline = read_baseline(str(path))
    assert sorted(baseline.acceptance) == ["ddtree@16", "ddtree@4", "dflash"]
    same = compare(results, [baseline], max_accept_diff=0.0, max_tv=0.0)
    assert same.ok and all(r.differing_requests == [] for r in same.rows)
    # one request decoded differently online: the comparison names it
    online = results.model_copy(deep=True)
    request = online.variants[2].runs[0].requests[1]
    request.accept_counts = [request.rounds] + [0] * 7
    flagged = compare(online, [baseline], max_accept_diff=10.0, max_tv=1.0)
    assert [r.differing_requests for r in flagged.rows] == [[], [], [1]]
