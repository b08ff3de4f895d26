"""tools/gpu/speed_interleave.py: the order it times servers in, and the medians, ratios and intervals it
reports.

The servers are stand-ins (this test only): ``ddtree_client.post`` is replaced by a function that
answers from a script of seconds per server and records which server each call went to; so no HTTP
client is needed, and an empty ``requests`` module stands in for the one ddtree_client imports.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.gpu_tools import load_gpu_tool


class Servers:
    """Each server decodes at a fixed speed, times a slowdown that is the same for every server
    within one repetition (a slow stretch of the machine)."""

    def __init__(self, tok_per_s: dict[str, float], slowdown: list[float]) -> None:
        self.tok_per_s, self.slowdown = tok_per_s, slowdown
        self.calls: list[str] = []
        self.timed: dict[str, int] = {}

    def post(self, url: str, payload: dict[str, Any], sp: dict[str, Any]) -> tuple[object, float]:
        port = url.rsplit(":", 1)[1]
        self.calls.append(port)
        prompts = payload["input_ids"]
        batch = isinstance(prompts[0], list)
        n = len(prompts) if batch else 1
        count = self.timed.get(port, 0)
        rep = (count - 1) // 8 if count else -1  # 8 calls a timing, after one warm-up call
        secs = n * sp["max_new_tokens"] / self.tok_per_s[port] * (self.slowdown[rep] if rep >= 0 else 1.0)
        self.timed[port] = self.timed.get(port, 0) + 1
        meta = {"completion_tokens": sp["max_new_tokens"], "spec_accept_length": 2.0}
        answer = [{"meta_info": meta}] * n if batch else {"meta_info": meta}
        return answer, secs


def test_medians_of_per_repetition_ratios_cancel_a_slow_stretch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "requests", sys.modules.get("requests") or ModuleType("requests"))
    tool = load_gpu_tool("speed_interleave")
    servers = Servers({"1": 1000.0, "2": 1500.0, "3": 800.0}, slowdown=[1.0, 3.0, 1.0, 1.0, 2.0])
    monkeypatch.setattr(tool.base, "post", servers.post)
    out = tmp_path / "speed.json"
    monkeypatch.setattr(sys, "argv", ["speed_interleave.py", str(out), "5", "dflash=1", "tree=2", "prev=3"])
    tool.main()
    result = json.loads(out.read_text())
    median = result["median"]
    assert result["baseline"] == "dflash"
    # A repetition's slowdown hits every server alike: every ratio is the servers' true ratio.
    assert median["tree"]["repeating_b1_vs_dflash"] == pytest.approx(1.5)
    assert median["tree"]["alternating_b4_vs_dflash"] == pytest.approx(1.5)
    assert median["prev"]["repeating_b4_vs_dflash_range"] == pytest.approx([0.8, 0.8])
    assert median["prev"]["repeating_b4_vs_dflash_interval"] == pytest.approx([0.8, 0.8])
    assert median["dflash"]["repeating_b1"] == pytest.approx(1000.0)  # median over 1x, 3x, 1x, 1x, 2x
    # The order rotates by one server each repetition (after the warm-up of each).
    timed = servers.calls[3:]
    firsts = [timed[i * 24] for i in range(5)]
    assert firsts == ["1", "2", "3", "1", "2"]


def test_ratios_between_two_cases_of_a_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    tool = load_gpu_tool("speed_interleave")
    timings = {"new": [{"repeating_b1": 3.0, "repeating_b1_accept": 8.0}, {"repeating_b1": 1.0, "repeating_b1_accept": 8.0},
                       {"repeating_b1": 5.0, "repeating_b1_accept": 8.0}],
               "old": [{"repeating_b1": 2.0, "repeating_b1_accept": 8.0}, {"repeating_b1": 1.0, "repeating_b1_accept": 8.0},
                       {"repeating_b1": 2.0, "repeating_b1_accept": 8.0}]}
    mid, low, high, low95, high95 = tool.ratios(timings, "new", "old")["repeating_b1"]
    assert (mid, low, high) == (1.5, 1.0, 2.5)
    assert low <= low95 <= mid <= high95 <= high  # the median's interval lies within the repetitions
    speed = tmp_path / "speed.json"
    speed.write_text(json.dumps({"timings": timings}))
    monkeypatch.setattr(sys, "argv", ["speed_interleave.py", "ratios", str(speed), "new", "old"])
    tool.main()
    assert f"new / old repeating_b1: 1.50x [1.00, 2.50] 95% {low95:.2f}-{high95:.2f}" in capsys.readouterr().out


def test_the_median_interval_resolves_what_the_range_does_not() -> None:
    """Many repetitions at 1.0 with a spread on both sides: the range spans 0.6-1.6, the bootstrap
    interval of the median stays at 1.0; a handful of spread repetitions leave it wide."""
    tool = load_gpu_tool("speed_interleave")
    many = [0.6] * 8 + [1.0] * 25 + [1.6] * 8
    assert tool.median_interval(many) == (1.0, 1.0)
    low95, high95 = tool.median_interval([0.6, 1.0, 1.6, 0.8, 1.3])
    assert low95 < 1.0 < high95
    assert tool.median_interval(many, seed=1) == tool.median_interval(many, seed=1)  # seeded: repeatable


def test_context_lengths_stretch_each_class(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SPEED_CONTEXTS adds each class again, its prompts repeated to that many tokens."""
    monkeypatch.setitem(sys.modules, "requests", sys.modules.get("requests") or ModuleType("requests"))
    tool = load_gpu_tool("speed_interleave")
    sent: list[list[int]] = []

    def post(url: str, payload: dict[str, Any], sp: dict[str, Any]) -> tuple[object, float]:
        prompts = payload["input_ids"]
        batch = prompts if isinstance(prompts[0], list) else [prompts]
        sent.extend(batch)
        meta = {"completion_tokens": sp["max_new_tokens"], "spec_accept_length": 2.0}
        answer = [{"meta_info": meta}] * len(batch) if isinstance(prompts[0], list) else {"meta_info": meta}
        return answer, 0.1 * len(batch)

    monkeypatch.setattr(tool.base, "post", post)
    monkeypatch.setenv("SPEED_CONTEXTS", "0,1000")
    out = tmp_path / "speed.json"
    monkeypatch.setattr(sys, "argv", ["speed_interleave.py", str(out), "1", "dflash=1", "tree=2"])
    tool.main()
    keys = set(json.loads(out.read_text())["median"]["tree"])
    assert {"repeating_b1", "repeating_c1000_b1", "alternating_c1000_b4", "repeating_c1000_b4_vs_dflash"} <= keys
    long = [p for p in sent if len(p) == 1000]
    assert long and all(len(set(p)) == 1 or p[:4] == p[4:8] for p in long)  # the patterns kept
    assert tool.stretched([1, 2], 5) == [1, 2, 1, 2, 1]
