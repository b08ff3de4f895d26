"""tools/gpu/grammar_mix.py: which request carries the grammar, what it counts, when it aborts the
companion, the order it times servers in and the medians it reports.

The servers are stand-ins (this test only): ``ddtree_client.post`` and the tool's ``abort`` are
replaced by functions that answer as a DDTREE or DFLASH server would in time. A companion request
(the one sent with a rid) stays "in the batch" until its rid is aborted; the neighbours' call
decodes its batch of four at the tree rate on a tree server unless the running companion carries a
grammar, when the whole batch takes the chain round (the overlay's fallback). An empty ``requests``
module stands in for the one the tools import where none is installed.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.gpu_tools import load_gpu_tool

CHAIN, TREE = 400.0, 1200.0  # tok/s of a four-request batch
COMPANION_TOKENS = 700  # what an aborted companion reports: never part of the neighbours' rate


class Servers:
    def __init__(self, tree_ports: set[str], slowdown: list[float], early: bool = False) -> None:
        self.tree_ports, self.slowdown, self.early = tree_ports, slowdown, early
        self.lock = threading.Lock()
        self.running: dict[str, dict[str, Any]] = {}  # port -> the companion in its batch
        self.arrived = {p: threading.Event() for p in ("1", "2")}
        self.batches: list[tuple[str, tuple[bool, ...]]] = []  # port, regex per request (companion first)
        self.aborted: list[tuple[str, str]] = []
        self.neighbour_calls: dict[str, int] = {}

    def post(self, url: str, payload: dict[str, Any], sp: dict[str, Any]) -> tuple[object, float]:
        port = url.rsplit(":", 1)[1]
        if "rid" in payload:  # the companion: decodes until aborted (or at once, when `early`)
            entry = {"rid": payload["rid"], "regex": "regex" in sp, "aborted": threading.Event()}
            assert isinstance(payload["input_ids"][0], int) and sp["max_new_tokens"] > 240
            with self.lock:
                self.running[port] = entry
            self.arrived[port].set()
            aborted = not self.early and entry["aborted"].wait(timeout=2)
            return {"meta_info": {"completion_tokens": COMPANION_TOKENS if aborted else sp["max_new_tokens"],
                                  "spec_accept_length": 1.5,
                                  "finish_reason": {"type": "abort" if aborted else "length"}}}, 0.5
        assert self.arrived[port].wait(timeout=10), "the neighbours came before their companion"
        self.arrived[port].clear()
        if self.early:
            time.sleep(0.3)  # the companion has returned by now
        companion = self.running[port]
        assert self.early or not companion["aborted"].is_set()
        n = len(payload["input_ids"])
        self.batches.append((port, (companion["regex"],) + ("regex" in sp,) * n))
        count = self.neighbour_calls[port] = self.neighbour_calls.get(port, 0) + 1
        rep = (count - 1) // 4 - 1  # 4 calls a timing, after one warm-up timing
        slow = self.slowdown[rep] if rep >= 0 else 1.0
        tree = port in self.tree_ports and not companion["regex"]
        secs = (n + 1) * sp["max_new_tokens"] / (TREE if tree else CHAIN) * slow
        meta = {"completion_tokens": sp["max_new_tokens"], "spec_accept_length": 6.0 if tree else 2.0}
        return [{"meta_info": dict(meta)} for _ in range(n)], secs

    def abort(self, url: str, rid: str) -> None:
        port = url.rsplit(":", 1)[1]
        self.aborted.append((port, rid))
        if self.running[port]["rid"] == rid:
            self.running[port]["aborted"].set()


def load(monkeypatch: pytest.MonkeyPatch, servers: Servers) -> Any:
    monkeypatch.setitem(sys.modules, "requests", sys.modules.get("requests") or ModuleType("requests"))
    tool = load_gpu_tool("grammar_mix")
    monkeypatch.setattr(tool.base, "post", servers.post)
    monkeypatch.setattr(tool, "abort", servers.abort)
    monkeypatch.setattr(tool, "LEAD_S", 0.01)
    return tool


def test_one_grammar_request_costs_its_tree_neighbours_the_tree(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    servers = Servers({"2"}, slowdown=[1.0, 3.0, 1.0])
    tool = load(monkeypatch, servers)
    out = tmp_path / "mix.json"
    monkeypatch.setattr(sys, "argv", ["grammar_mix.py", str(out), "3", "dflash=1", "ddtree=2"])
    tool.main()
    result = json.loads(out.read_text())
    median = result["median"]
    # per server, batches alternate free / mixed; in a mixed one the regex rides on exactly one
    # request, the companion, and never on a neighbour
    assert len(servers.batches) == 2 * 4 * 4
    for port in ("1", "2"):
        flags = [f for p, f in servers.batches if p == port]
        assert flags == [(False,) * 4, (True, False, False, False)] * 8
    # each companion was aborted, by its own rid, once its neighbours were done
    rids = [rid for _, rid in servers.aborted]
    assert len(rids) == 32 and len(set(rids)) == 32
    assert all(rid.startswith("grammar-mix-") for rid in rids)
    assert median["ddtree"]["companions_not_outliving"] == 0
    assert result["timings"]["ddtree"][0]["alternating_mixed"]["companion"]["finish"] == "abort"
    # timed servers in rotated order after one warm-up timing each: 1 2 | 1 2 | 2 1 | 1 2
    timed_ports = [port for port, _ in servers.batches[8:]][::4]
    assert timed_ports == ["1", "2", "2", "1", "1", "2"]
    # neighbours' rate: their three 240-token answers over their call's time (the batch of four
    # decodes 4 x 240 tokens in it); the companion's 700 tokens are recorded, not counted
    assert median["dflash"]["alternating_free"] == pytest.approx(3 * 240 / (4 * 240 / CHAIN))
    assert median["ddtree"]["alternating_constrained_tokens"] == COMPANION_TOKENS
    assert median["ddtree"]["alternating_free_accept"] == 6.0
    assert median["ddtree"]["alternating_mixed_accept"] == 2.0
    # a slow repetition hits both modes and both servers alike: the ratios are the true ones
    assert median["ddtree"]["alternating_mixed_over_free"] == pytest.approx(CHAIN / TREE)
    assert median["ddtree"]["repeating_free_vs_dflash"] == pytest.approx(TREE / CHAIN)
    assert median["ddtree"]["repeating_mixed_vs_dflash"] == pytest.approx(1.0)
    assert median["dflash"]["alternating_mixed_over_free"] == pytest.approx(1.0)
    assert median["dflash"]["repeating_free"] == pytest.approx(300.0)  # median over 1x, 3x, 1x


def test_a_companion_that_ends_before_its_neighbours_is_flagged(monkeypatch: pytest.MonkeyPatch) -> None:
    servers = Servers({"2"}, slowdown=[1.0], early=True)
    tool = load(monkeypatch, servers)
    timing = tool.time_mode("http://127.0.0.1:2", tool.base.ALT, True)
    assert timing["companion"]["outlived"] is False
    assert timing["companion"]["finish"] == "length"
    assert timing["companion"]["tokens"] == tool.LONG
    assert timing["tok_s"] == pytest.approx(3 * 240 / (4 * 240 / CHAIN))
