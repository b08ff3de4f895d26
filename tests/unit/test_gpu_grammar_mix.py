"""tools/gpu/grammar_mix.py: which request carries the grammar, what it counts, the order it times
servers in and the medians it reports.

The servers are stand-ins (this test only): ``ddtree_client.post`` is replaced by a function that
answers a four-request call as a DDTREE or DFLASH server would in time: a tree server decodes its
batch at its tree rate unless a request carries a grammar, when the whole batch takes the chain
round (the overlay's fallback); an empty ``requests`` module stands in for the one ddtree_client imports.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.gpu_tools import load_gpu_tool

CHAIN, TREE = 400.0, 1200.0  # tok/s of a four-request batch on the alternating prompts


class Servers:
    def __init__(self, tree_ports: set[str], slowdown: list[float]) -> None:
        self.tree_ports, self.slowdown = tree_ports, slowdown
        self.calls: list[tuple[str, list[bool]]] = []

    def post(self, url: str, payload: dict[str, Any], params: list[dict[str, Any]]) -> tuple[object, float]:
        port = url.rsplit(":", 1)[1]
        constrained = ["regex" in p for p in params]
        self.calls.append((port, constrained))
        tree = port in self.tree_ports and not any(constrained)
        rep = (len([c for c in self.calls if c[0] == port]) - 1) // 4 - 1  # 4 calls a timing, one warm-up timing
        slow = self.slowdown[rep] if rep >= 0 else 1.0
        tokens = sum(p["max_new_tokens"] for p in params)
        secs = tokens / (TREE if tree else CHAIN) * slow
        meta = {"completion_tokens": params[0]["max_new_tokens"], "spec_accept_length": 6.0 if tree else 2.0}
        assert len(payload["input_ids"]) == len(params) == 4
        return [{"meta_info": dict(meta)} for _ in params], secs


def test_one_grammar_request_costs_its_tree_neighbours_the_tree(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "requests", sys.modules.get("requests") or ModuleType("requests"))
    tool = load_gpu_tool("grammar_mix")
    servers = Servers({"2"}, slowdown=[1.0, 3.0, 1.0])
    monkeypatch.setattr(tool.base, "post", servers.post)
    out = tmp_path / "mix.json"
    monkeypatch.setattr(sys, "argv", ["grammar_mix.py", str(out), "3", "dflash=1", "ddtree=2"])
    tool.main()
    result = json.loads(out.read_text())
    median = result["median"]
    # the regex rides on exactly one request, the last, and only in mixed calls
    assert {tuple(c) for _, c in servers.calls} == {(False,) * 4, (False, False, False, True)}
    # timed servers in rotated order after one warm-up timing each: 1 2 | 1 2 | 2 1 | 1 2
    timed_ports = [port for port, _ in servers.calls[8:]][::4]
    assert timed_ports == ["1", "2", "2", "1", "1", "2"]
    # neighbours' rate: three requests' 240 tokens over the call's time
    assert median["dflash"]["alternating_free"] == pytest.approx(3 * 240 / (4 * 240 / CHAIN))
    assert median["ddtree"]["alternating_free_accept"] == 6.0
    assert median["ddtree"]["alternating_mixed_accept"] == 2.0
    # a slow repetition hits both modes and both servers alike: the ratios are the true ones
    assert median["ddtree"]["alternating_mixed_over_free"] == pytest.approx(CHAIN / TREE)
    assert median["ddtree"]["repeating_free_vs_dflash"] == pytest.approx(TREE / CHAIN)
    assert median["ddtree"]["repeating_mixed_vs_dflash"] == pytest.approx(1.0)
    assert median["dflash"]["alternating_mixed_over_free"] == pytest.approx(1.0)
