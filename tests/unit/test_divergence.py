"""Where a greedy answer parts from its reference, and when a near-tie of the reference explains it."""

from __future__ import annotations

import pytest

from ddtree_deploy.divergence import compare, top_logprobs

# the reference took 7, then 8 (its runner-up 9 close behind: gap 0.125), then 10 (runner-up 11, gap 3)
EXPECTED = [7, 8, 10]
TOP = [[(-0.1, 7), (-2.0, 5)], [(-0.5, 8), (-0.625, 9)], [(-0.01, 10), (-3.01, 11)]]


def test_identical_answers_are_identical_whatever_the_tolerance() -> None:
    assert compare(EXPECTED, list(EXPECTED), TOP, tolerance=0.0).kind == "identical"
    assert compare(EXPECTED, list(EXPECTED), None).kind == "identical"


def test_a_split_to_the_runner_up_within_the_tolerance_is_a_near_tie_with_its_gap() -> None:
    split = compare(EXPECTED, [7, 9, 4], TOP, tolerance=0.25)
    assert (split.kind, split.index, split.expected, split.got) == ("near_tie", 1, 8, 9)
    assert split.gap == pytest.approx(0.125)
    assert "near-tie" in split.describe() and "0.125" in split.describe()


def test_a_split_to_a_third_token_tied_with_the_best_is_a_near_tie_when_recorded() -> None:
    three_way = [[(-1.0, 7), (-1.0625, 5), (-1.125, 6), (-4.0, 2)]]  # bf16: three within 1/8 nat
    split = compare([7], [6], three_way, tolerance=0.5)
    assert (split.kind, split.gap) == ("near_tie", pytest.approx(0.125))
    assert compare([7], [2], three_way, tolerance=0.5).kind == "mismatch"  # recorded, but 3 nats away


def test_a_split_beyond_the_tolerance_or_with_tolerance_zero_is_a_mismatch() -> None:
    assert compare(EXPECTED, [7, 8, 11], TOP, tolerance=0.5).kind == "mismatch"  # gap 3
    assert compare(EXPECTED, [7, 9, 4], TOP, tolerance=0.0).kind == "mismatch"  # gap 0.125 > 0


def test_a_token_outside_the_references_best_or_without_log_probs_is_a_mismatch() -> None:
    outside = compare(EXPECTED, [7, 3], TOP, tolerance=10.0)
    assert (outside.kind, outside.index, outside.gap) == ("mismatch", 1, None)
    assert compare(EXPECTED, [7, 9, 4], None, tolerance=10.0).kind == "mismatch"
    assert compare(EXPECTED, [7, 9, 4], TOP[:1], tolerance=10.0).kind == "mismatch"  # no row at the split


def test_a_shorter_or_longer_answer_is_a_mismatch_at_the_end() -> None:
    short = compare(EXPECTED, [7, 8], TOP, tolerance=10.0)
    assert (short.kind, short.index, short.got) == ("mismatch", 2, None)
    assert "got end" in short.describe()
    assert compare(EXPECTED, [*EXPECTED, 1], TOP).kind == "mismatch"


def test_sglang_top_logprobs_parse_with_text_and_empty_rows() -> None:
    meta = {"output_top_logprobs": [[[-0.1, 7, "a"], [-2.0, 5, "b"]], None, [[-0.2, 3, None]]]}
    assert top_logprobs(meta) == [[(-0.1, 7), (-2.0, 5)], [], [(-0.2, 3)]]
    assert top_logprobs({}) is None
    assert top_logprobs({"output_top_logprobs": [[["x", "y"]]]}) is None
