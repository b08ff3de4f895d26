"""tools/gpu/sample_compare.py's rank counting and chi-square test (the GPU sampling check's verdict)."""

from __future__ import annotations

import random
from types import ModuleType

from tests.gpu_tools import load_gpu_tool


def tool() -> ModuleType:
    return load_gpu_tool("sample_compare")


def test_rank_of_names_outside_tokens_by_top() -> None:
    t = tool()
    assert t.rank_of(7, [7, 3, 9]) == 0
    assert t.rank_of(9, [7, 3, 9]) == 2
    assert t.rank_of(4, [7, 3, 9]) == t.TOP


def test_rank_counts_are_per_position() -> None:
    counts = tool().rank_counts([[0, 2], [1, 2], [0, 3]])
    assert counts == [[2, 1, 0, 0], [0, 0, 2, 1]]


def test_chi_square_p_value_matches_the_table() -> None:
    # [[60, 40], [46, 54]]: statistic 200 (60*54 - 40*46)^2 / (106*94*100*100) = 3.934, p 0.0473 (dof 1).
    stat, dof, p = tool().chi_square([60, 40], [46, 54])
    assert dof == 1
    assert abs(stat - 3.934) < 0.001
    assert abs(p - 0.0473) < 0.0001


def test_same_distribution_passes_and_a_dropped_rank_fails() -> None:
    t = tool()
    rng = random.Random(0)
    draw = lambda weights: [rng.choices(range(4), weights)[0] for _ in range(1500)]  # noqa: E731
    plain = draw([0.4, 0.33, 0.27, 0])
    same = draw([0.4, 0.33, 0.27, 0])
    two_kept = draw([0.55, 0.45, 0, 0])
    counts = lambda xs: [xs.count(r) for r in range(4)]  # noqa: E731
    assert t.chi_square(counts(plain), counts(same))[2] > t.ALPHA
    stat, dof, p = t.chi_square(counts(plain), counts(two_kept))
    assert dof == 2 and p < 1e-30


def test_by_prompt_splits_one_position_per_prompt() -> None:
    samples = [{"prompt": [1]}, {"prompt": [2]}, {"prompt": [1]}]
    counts = tool().by_prompt(samples, [[0, 2], [1, 1], [0, 0]], 1)
    assert counts == {"[1]": [1, 0, 1, 0], "[2]": [0, 1, 0, 0]}


def contexts() -> ModuleType:
    return load_gpu_tool("sample_contexts")


def test_masses_above_are_the_cumulative_sums_before_each_rank() -> None:
    assert contexts().masses_above([0.5, 0.25, 0.125]) == [0.0, 0.5, 0.75]


def test_the_most_common_context_and_the_draws_after_it() -> None:
    samples = [{"prompt": [1], "output_ids": [7, 8, 9]}, {"prompt": [1], "output_ids": [7, 8, 4]},
               {"prompt": [1], "output_ids": [6, 8, 9]}, {"prompt": [2], "output_ids": [3, 3, 3]}]
    tool = contexts()
    assert tool.most_common_contexts(samples, 3) == {"[1]": (7, 8), "[2]": (3, 3)}
    assert tool.draws_at(samples, "[1]", (7, 8), [9, 5]) == [1, 0, 1]


def test_rare_cells_are_pooled_before_the_test() -> None:
    t = tool()
    assert t.pooled([500, 0, 2, 0], [497, 0, 1, 3]) == [(500, 497), (2, 4)]
    assert t.chi_square([500, 0, 2, 0], [497, 0, 1, 3])[1] == 1  # two cells left: one degree of freedom
