"""Overlay ddtree 0.3.0-rc.16's top-K: where no Triton kernel runs (the CPU), its int64 key gives 0.1.0's
``_ddtree_top_k`` log-probs and tokens bit for bit on every logit family of the tree tests, ties, masked
(-inf) vocabularies and fully masked rows included; on CUDA it takes the Triton 32-bit select (whose
interpreted kernels tests/ddtree/test_tree_build_triton.py holds to the key); and bench/top_k.py fails
when the top-K it times differs from the reference, or (rc.20 on) the device's log-probs from the CPU's
by more than a rounding."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest
import torch

from bench import top_k as bench

RC16 = "ddtree@0.3.0-rc.16"
FAMILIES = ["sharp", "flat", "bf16", "integer", "masked"]


@pytest.fixture(scope="module")
def rc16(decode_tool: ModuleType) -> ModuleType:
    return decode_tool.load_overlay_module(RC16, "sglang/srt/speculative/ddtree_utils.py")


def test_cuda_takes_the_triton_select_up_to_its_k(dd010: ModuleType, rc16: ModuleType,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    assert rc16._ddtree_triton_top_k(torch.device("cpu")) is None  # the CPU keeps the int64 key
    calls: list[int] = []

    def fused(*, log_probs: torch.Tensor, ordered: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(k)
        return log_probs[..., :k], ordered[..., :k].long()

    monkeypatch.setattr(rc16, "_ddtree_triton_top_k", lambda device: fused)
    widest = rc16._DDTREE_TRITON_TOP_K_MAX_K
    logits = torch.randn(1, 2, widest + 10)
    rc16._ddtree_top_k(logits, widest)
    _, tokens = rc16._ddtree_top_k(logits, widest + 1)  # past the kernels' sort: the int64 key
    assert calls == [widest] and torch.equal(tokens, dd010._ddtree_top_k(logits, widest + 1)[1])


@pytest.mark.parametrize("family", FAMILIES)
def test_rc16_top_k_is_the_reference_top_k(dd010: ModuleType, rc16: ModuleType,
                                           make_logits: Callable[..., torch.Tensor], family: str) -> None:
    for seed in range(10):
        logits = make_logits(family, (2, 4, 30 + seed), seed)
        for k in {1, 1 + 3 * seed, logits.shape[-1]}:
            assert bench.same_top_k(dd010._ddtree_top_k(logits, k), rc16._ddtree_top_k(logits, k)), (family, seed, k)


def test_a_fully_masked_row_keeps_the_reference_order(dd010: ModuleType, rc16: ModuleType) -> None:
    logits = torch.randn(2, 3, 40, generator=torch.Generator().manual_seed(3))
    logits[0, 1] = float("-inf")  # log_softmax gives NaN there
    for k in (5, 40):
        assert bench.same_top_k(dd010._ddtree_top_k(logits, k), rc16._ddtree_top_k(logits, k)), k


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


def test_the_bench_fails_when_the_log_probs_are_more_than_a_rounding_off(monkeypatch: pytest.MonkeyPatch,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """The device's log-probs (the first of each pair of calls) two units in the last place off the CPU's."""
    core, kernel = bench.load_newest_pair()
    honest = core._ddtree_log_probs_and_images
    calls: list[torch.Tensor] = []

    def two_units_off_on_the_device(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        log_probs, images = honest(logits)
        calls.append(logits)
        if len(calls) % 2:
            log_probs = (log_probs.view(torch.int32) + 2).view(torch.float32)
        return log_probs, images

    logits = torch.randn(2, 3, 50, generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(core, "_ddtree_log_probs_and_images", two_units_off_on_the_device)
    assert bench.log_probs_gap(core, logits) == (2, logits.numel())
    monkeypatch.setattr(bench, "load_newest_pair", lambda: (core, kernel))
    assert bench.main(["--device", "cpu", "--no-timing", "--budgets", "16", "--batch", "1", "--vocab", "512"]) == 1
    assert "WRONG" in capsys.readouterr().out
