"""bench/top_k.py's chunked top-K (the top-K of each chunk of a row, then of their candidates) and its
repaired 32-bit top-K (a 32-bit select, the ties at its cut replaced by the smallest token ids) give
``_ddtree_top_k``'s log-probs and tokens bit for bit on every logit family of the tree tests, ties
and masked (-inf) vocabularies included; and the bench itself fails when a variant differs."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest
import torch

from bench import top_k as bench

FAMILIES = ["sharp", "flat", "bf16", "integer", "masked"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("chunks", [1, 3, 7])
def test_chunked_top_k_is_the_reference_top_k(dd: ModuleType, make_logits: Callable[..., torch.Tensor],
                                               family: str, chunks: int) -> None:
    for seed in range(6):
        logits = make_logits(family, (2, 4, 60 + seed), seed)
        k = min(8 + seed, logits.shape[-1] // chunks)
        want = dd._ddtree_top_k(logits, k)
        got = bench.chunked_top_k(logits, k, chunks)
        assert torch.equal(want[1], got[1]) and torch.equal(want[0], got[0]), (family, seed)


@pytest.mark.parametrize("family", FAMILIES)
def test_repaired_top_k_is_the_reference_top_k(dd: ModuleType, make_logits: Callable[..., torch.Tensor],
                                               family: str) -> None:
    for seed in range(8):
        logits = make_logits(family, (2, 4, 30 + seed), seed)
        k = min(1 + 3 * seed, logits.shape[-1])
        want = dd._ddtree_top_k(logits, k)
        got = bench.repaired_top_k(logits, k)
        assert torch.equal(want[1], got[1]) and torch.equal(want[0], got[0]), (family, seed)


def test_repaired_top_k_takes_the_smallest_ids_of_a_tie_at_its_cut() -> None:
    logits = torch.zeros(1, 2, 50)
    logits[0, 0, [40, 7]] = 2.0  # two above the cut, then 48 tokens tied for the last 3 places
    logits[0, 1, :] = -1.0
    logits[0, 1, [49, 30, 2, 11]] = 0.5  # a tie of four above, cut inside it at k = 3
    _, tokens = bench.repaired_top_k(logits, 3)
    assert tokens.tolist() == [[[7, 40, 0], [2, 11, 30]]]


def test_equal_log_probs_come_out_by_token_id_across_chunks() -> None:
    logits = torch.zeros(1, 1, 40)
    logits[0, 0, [35, 3, 22, 17]] = 1.0  # a tie spread over all four chunks of 10
    _, tokens = bench.chunked_top_k(logits, 6, 4)
    assert tokens.tolist() == [[[3, 17, 22, 35, 0, 1]]]


def test_the_bench_reports_a_variant_that_differs(monkeypatch: pytest.MonkeyPatch) -> None:
    assert bench.main(["--device", "cpu", "--no-timing", "--budgets", "16", "--batch", "1", "--vocab", "512",
                       "--chunks", "4"]) == 0
    real = bench.vocabulary_keys
    monkeypatch.setattr(bench, "vocabulary_keys", lambda logits: (real(logits)[0], real(logits)[1] ^ 1))
    assert bench.main(["--device", "cpu", "--no-timing", "--budgets", "16", "--batch", "1", "--vocab", "512",
                       "--chunks", "4"]) == 1
