"""Overlay ddtree 0.3.0-rc.16's top-K gives 0.1.0's int64-key ``_ddtree_top_k`` log-probs and tokens bit for
bit on every logit family of the tree tests, ties, masked (-inf) vocabularies and fully masked rows
included, down both of its paths (the int64 key below ``_DDTREE_SELECT32_MIN_ROWS`` rows, a 32-bit select
whose ties at its cut are repaired from there); and bench/top_k.py fails when a top-K it times differs
from the reference."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest
import torch

from bench import top_k as bench

RC16 = "ddtree@0.3.0-rc.16"
FAMILIES = ["sharp", "flat", "bf16", "integer", "masked"]


@pytest.fixture(scope="module")
def core(decode_tool: ModuleType) -> ModuleType:
    return decode_tool.load_overlay_module(RC16, "sglang/srt/speculative/ddtree_utils.py")


@pytest.fixture(params=["key64", "select32"])
def rc16(core: ModuleType, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> ModuleType:
    """rc.16's core with its top-K's path forced (the threshold of its rule moved past every case)."""
    monkeypatch.setattr(core, "_DDTREE_SELECT32_MIN_ROWS", 1 << 30 if request.param == "key64" else 0)
    return core


def test_the_rule_takes_the_select_from_its_row_count(core: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    for path in ("key64", "select32"):
        real = getattr(core, f"_ddtree_{path}_tokens")
        monkeypatch.setattr(core, f"_ddtree_{path}_tokens", lambda o, k, p=path, f=real: calls.append(p) or f(o, k))
    rows = core._DDTREE_SELECT32_MIN_ROWS
    core._ddtree_top_k(torch.randn(1, rows - 1, 50), 4)
    core._ddtree_top_k(torch.randn(2, rows // 2, 50), 4)
    assert calls == ["key64", "select32"]


def assert_same_top_k(want: tuple[torch.Tensor, torch.Tensor], got: tuple[torch.Tensor, torch.Tensor]) -> None:
    assert torch.equal(want[1], got[1])
    assert torch.equal(want[0].view(torch.int32), got[0].view(torch.int32))  # NaN rows bit for bit too


@pytest.mark.parametrize("family", FAMILIES)
def test_rc16_top_k_is_the_reference_top_k(dd010: ModuleType, rc16: ModuleType,
                                           make_logits: Callable[..., torch.Tensor], family: str) -> None:
    for seed in range(10):
        logits = make_logits(family, (2, 4, 30 + seed), seed)
        for k in {1, 1 + 3 * seed, logits.shape[-1]}:
            assert_same_top_k(dd010._ddtree_top_k(logits, k), rc16._ddtree_top_k(logits, k))


def test_a_fully_masked_row_keeps_the_reference_order(dd010: ModuleType, rc16: ModuleType) -> None:
    logits = torch.randn(2, 3, 40, generator=torch.Generator().manual_seed(3))
    logits[0, 1] = float("-inf")  # log_softmax gives NaN there
    for k in (5, 40):
        assert_same_top_k(dd010._ddtree_top_k(logits, k), rc16._ddtree_top_k(logits, k))


def test_the_smallest_ids_of_a_tie_at_the_cut_are_taken(rc16: ModuleType) -> None:
    logits = torch.zeros(1, 2, 50)
    logits[0, 0, [40, 7]] = 2.0  # two above the cut, then 48 tokens tied for the last 3 places
    logits[0, 1, :] = -1.0
    logits[0, 1, [49, 30, 2, 11]] = 0.5  # a tie of four above, cut inside it at k = 3
    _, tokens = rc16._ddtree_top_k(logits, 3)
    assert tokens.tolist() == [[[7, 40, 0], [2, 11, 30]]]


def test_the_bench_fails_when_the_top_k_it_times_differs(monkeypatch: pytest.MonkeyPatch) -> None:
    run = ["--device", "cpu", "--no-timing", "--budgets", "16", "--batch", "1", "--vocab", "512"]
    assert bench.main(run) == 0
    core, kernel = bench.load_newest_pair()
    monkeypatch.setattr(core, "_ddtree_top_k", bench.float_top_k)
    monkeypatch.setattr(bench, "load_newest_pair", lambda: (core, kernel))
    assert bench.main(run) == 1  # the float32 floor takes a planted tie in another order
