"""Tree building: the reference heap against brute force, the batch builder against the heap."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from types import ModuleType

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

FAMILIES = ["sharp", "flat", "bf16", "integer", "masked"]
MakeLogits = Callable[[str, tuple[int, ...], int], torch.Tensor]


def rank_paths(dd: ModuleType, logits: torch.Tensor, tree: object) -> list[tuple[int, ...]]:
    """Rank path of every node of a tree, from its tokens and parents."""
    _, top_tokens = dd._ddtree_top_k(logits, min(tree.budget, logits.shape[-1]))
    parents, tokens, depths = tree.parents.tolist(), tree.tokens.tolist(), tree.depths.tolist()
    paths: list[tuple[int, ...]] = [()]
    for i, token in enumerate(tokens):
        rank = top_tokens[depths[i] - 1].tolist().index(token)
        paths.append(paths[parents[i + 1]] + (rank,))
    return paths[1:]


def assert_same_tree(single: object, batch_tree: object) -> None:
    """Same nodes in the same order, bit-identical scores."""
    for name in ("tokens", "depths", "parents", "scores", "visibility"):
        assert torch.equal(getattr(single, name), getattr(batch_tree, name)), name


# --------------------------------------------------------------------------- reference heap
@pytest.mark.parametrize("family", FAMILIES)
def test_heap_picks_the_top_budget_nodes_by_brute_force(dd: ModuleType, make_logits: MakeLogits, family: str) -> None:
    for seed in range(12):
        length, vocab = 1 + seed % 3, 2 + seed % 4
        logits = make_logits(family, (length, vocab), seed)
        rows = torch.log_softmax(logits.float(), -1).double().sort(-1, descending=True).values.tolist()
        every = {}  # rank path -> exact float64 path sum, every finite node of the full tree
        for depth in range(1, length + 1):
            for path in itertools.product(range(vocab), repeat=depth):
                values = [rows[d][r] for d, r in enumerate(path)]
                if all(math.isfinite(v) for v in values):
                    every[path] = math.fsum(values)
        for budget in range(0, len(every) + 3):
            tree = dd.build_ddtree_tree(logits, budget)
            dd.assert_prefix_closed(tree)
            chosen = rank_paths(dd, logits, tree)
            assert len(chosen) == min(max(budget, 0), len(every))
            assert set(chosen) <= set(every)
            if not chosen:
                continue
            cut = min(every[p] for p in chosen)
            for path, score in every.items():
                if path not in chosen:  # nothing left out beats the cut, ties only at the cut
                    assert score <= cut + 1e-9, (path, score, cut)
            assert all(abs(every[p] - s) < 1e-9 for p, s in zip(chosen, tree.scores.tolist(), strict=True))


def test_heap_score_arithmetic_is_the_reference_fold(dd: ModuleType) -> None:
    # Scores replay the reference heap: sibling = (node - logp[r]) + logp[r + 1], left to right.
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(3)) * 3
    tree = dd.build_ddtree_tree(logits, 60)
    top, _ = dd._ddtree_top_k(logits, 40)
    lp = top.double().tolist()
    by_path = dict(zip(rank_paths(dd, logits, tree), tree.scores.tolist(), strict=True))
    for path, score in by_path.items():
        depth, rank = len(path), path[-1]
        parent = 0.0 if depth == 1 else by_path[path[:-1]]
        expected = parent + lp[depth - 1][0]
        for r in range(rank):
            expected = expected - lp[depth - 1][r] + lp[depth - 1][r + 1]
        assert score == expected


def test_budget_equal_to_depth_is_not_a_chain(dd: ModuleType) -> None:
    # Two near-equal tokens at every depth: a budget of L nodes branches instead of going deep.
    length, vocab = 6, 50
    logits = torch.zeros(length, vocab)
    logits[:, 7] = 5.0
    logits[:, 9] = 4.9
    tree = dd.build_ddtree_tree(logits, length)
    assert tree.num_nodes == length
    assert int(tree.depths.max()) < length
    assert dd.summarize_ddtree(tree)["max_branching"] > 1


def test_flat_rows_rank_tokens_by_id_and_token_zero_is_a_node(dd: ModuleType) -> None:
    tree = dd.build_ddtree_tree(torch.zeros(2, 10), 4)
    # Four equal-score depth-1 siblings beat every depth-2 node; ranks follow token ids.
    assert tree.tokens.tolist() == [0, 1, 2, 3]
    assert tree.depths.tolist() == [1, 1, 1, 1]
    assert (0, 0) in tree.child_map


def test_masked_vocabulary_gives_no_nan_and_no_minus_inf_nodes(dd: ModuleType) -> None:
    logits = torch.full((3, 8), float("-inf"))
    logits[:, :2] = torch.tensor([1.0, 0.5])
    tree = dd.build_ddtree_tree(logits, 100)
    assert tree.num_nodes == 2 + 4 + 8  # the whole finite binary tree, fewer than the budget
    assert torch.isfinite(tree.scores).all()
    # A fully masked row (log_softmax gives NaN there) ends the tree at the previous depth.
    logits[1] = float("-inf")
    tree = dd.build_ddtree_tree(logits, 100)
    assert tree.num_nodes == 2 and torch.isfinite(tree.scores).all()


@pytest.mark.parametrize("budget", [0, -3])
def test_non_positive_budget_gives_a_root_only_tree(dd: ModuleType, budget: int) -> None:
    tree = dd.build_ddtree_tree(torch.randn(4, 16), budget)
    assert tree.num_nodes == 0 and tree.parents.tolist() == [-1]
    assert tree.visibility.tolist() == [[True]]
    batch = dd.build_ddtree_batch(torch.randn(2, 4, 16), budget)
    assert batch.num_nodes.tolist() == [0, 0] and batch.parents.shape == (2, max(budget, 0) + 1)


@pytest.mark.parametrize(
    ("shape", "budget"),
    [((4,), 3), ((2, 3, 4, 5), 3)],
)
def test_bad_logits_shapes_are_refused(dd: ModuleType, shape: tuple[int, ...], budget: int) -> None:
    builder = dd.build_ddtree_tree if len(shape) == 1 else dd.build_ddtree_batch
    with pytest.raises(ValueError, match="dimensions"):
        builder(torch.randn(shape), budget)


def test_non_int_budget_is_refused(dd: ModuleType) -> None:
    with pytest.raises(ValueError, match="budget must be an int"):
        dd.build_ddtree_batch(torch.randn(1, 2, 3), 4.0)


# --------------------------------------------------------------------------- batch == single
CASES = [
    # (family, batch, L, V, budgets)
    ("sharp", 3, 7, 300, [1, 5, 16, 64, 200]),
    ("flat", 3, 7, 300, [1, 5, 16, 64, 200]),
    ("bf16", 3, 7, 200, [2, 16, 64, 150]),
    ("integer", 3, 6, 40, [3, 16, 64, 300]),
    ("masked", 3, 5, 12, [1, 8, 40, 500]),
    ("flat", 2, 1, 50, [1, 10, 49, 50, 80]),  # L = 1
    ("integer", 2, 4, 3, [2, 5, 20, 200]),  # V < budget; budget beyond the whole tree (120 nodes)
]


# The newest version's core (what the worker imports on the GPU), and 0.1.0's (several fold passes).
CORES = ["dd", "dd010"]


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize(("family", "bs", "length", "vocab", "budgets"), CASES)
def test_batch_builder_equals_heap(
    request: pytest.FixtureRequest,
    core: str,
    make_logits: MakeLogits,
    family: str,
    bs: int,
    length: int,
    vocab: int,
    budgets: list[int],
) -> None:
    dd = request.getfixturevalue(core)
    logits = make_logits(family, (bs, length, vocab), seed=length * 1000 + vocab)
    for budget in budgets:
        batch = dd.build_ddtree_batch(logits, budget)
        assert batch.tokens.shape == (bs, budget) and batch.visibility.shape == (bs, budget + 1, budget + 1)
        assert batch.scores_exact.all()
        for b in range(bs):
            single = dd.build_ddtree_tree(logits[b], budget)
            assert_same_tree(single, batch.tree(b))
            assert int(batch.num_nodes[b]) == single.num_nodes


@pytest.mark.parametrize("core", CORES)
def test_batch_builder_equals_heap_on_a_qwen_sized_vocabulary(request: pytest.FixtureRequest, core: str) -> None:
    dd = request.getfixturevalue(core)
    g = torch.Generator().manual_seed(11)
    logits = (torch.randn(2, 3, 151936, generator=g) * 3).to(torch.bfloat16)
    logits[0, 1, 0] = 40.0  # token 0 is the near-certain draft at depth 2
    batch = dd.build_ddtree_batch(logits, 24)
    for b in range(2):
        assert_same_tree(dd.build_ddtree_tree(logits[b], 24), batch.tree(b))
    assert 0 in batch.tree(0).tokens.tolist()


def test_batch_padding_is_inert(dd: ModuleType) -> None:
    logits = torch.full((1, 2, 6), float("-inf"))
    logits[..., :2] = 0.0  # 2 + 4 = 6 finite nodes, budget 10
    batch = dd.build_ddtree_batch(logits, 10)
    assert batch.num_nodes.tolist() == [6]
    pad = slice(6, 10)
    assert batch.tokens[0, pad].tolist() == [0] * 4 and batch.depths[0, pad].tolist() == [1] * 4
    assert batch.parents[0, 7:].tolist() == [0] * 4 and torch.isinf(batch.scores[0, pad]).all()


def engineered_rounding_logits(rng: torch.Generator) -> torch.Tensor:
    """Logits whose float64 sibling folds round differently from a closed-form sum.

    Near-certain rows leave log-probs of about -1e-7 with low bits; a -3000 step then makes
    the score need more than 53 bits, and a row of widely spaced log-probs crosses several
    binades, so the heap's sibling fold rounds at each crossing.
    """
    u = lambda lo, hi: float(torch.empty(1).uniform_(lo, hi, generator=rng))  # noqa: E731
    x = torch.full((6, 48), float("-inf"))
    for d in range(3):
        x[d, 3 + d], x[d, 30 + d] = 0.0, -u(13, 15.5)
    x[3, 9], x[3, 0] = 0.0, -u(2500, 3500)
    row = [0.0, -0.7] + sorted((-u(1000, 30000) for _ in range(14)), reverse=True)
    x[4, 10 : 10 + len(row)] = torch.tensor(row)
    x[5, :4] = torch.tensor([0.0, -0.3, -1.1, -2.0])
    return x


def test_batch_builder_replays_the_heaps_float64_rounding(dd010: ModuleType) -> None:
    """0.1.0's core replays two rounding events per depth: every engineered tree comes out exact.
    (The newest replays one and flags the rest: test_the_newest_core_never_diverges_silently.)"""
    dd = dd010
    rng = torch.Generator().manual_seed(0)
    rounded = 0
    for trial in range(40):
        logits = engineered_rounding_logits(rng)
        budget = [60, 150, 400, 2000][trial % 4]
        single = dd.build_ddtree_tree(logits, budget)
        batch = dd.build_ddtree_batch(logits[None], budget)
        assert_same_tree(single, batch.tree(0))
        top, _ = dd._ddtree_top_k(logits, min(budget, 48))
        parents, scores = single.parents.tolist(), [0.0] + single.scores.tolist()
        for i, path in enumerate(rank_paths(dd, logits, single), 1):
            closed_form = scores[parents[i]] + top[len(path) - 1, path[-1]].double().item()
            rounded += closed_form != scores[i]
    assert rounded > 0  # the case really exercises the fold replay


@pytest.mark.parametrize("passes", [0, 1])
def test_fewer_fold_passes_never_diverge_silently(dd010: ModuleType, passes: int) -> None:
    """0.1.0's `sibling_fold_passes=` (the newest core's pass count is fixed at one)."""
    dd = dd010
    rng = torch.Generator().manual_seed(1)
    diverged = 0
    for trial in range(40):
        logits = engineered_rounding_logits(rng)
        budget = [60, 150, 400, 2000][trial % 4]
        batch = dd.build_ddtree_batch(logits[None], budget, sibling_fold_passes=passes)
        single = dd.build_ddtree_tree(logits, budget)
        same = all(torch.equal(getattr(single, f), getattr(batch.tree(0), f)) for f in ("tokens", "parents", "scores"))
        diverged += not same
        assert same or not bool(batch.scores_exact[0]), trial
    assert diverged > 0  # the flag had something to catch
    with pytest.raises(ValueError, match="sibling_fold_passes"):
        dd.build_ddtree_batch(logits[None], 4, sibling_fold_passes=-1)


# --------------------------------------------------------------------------- no host sync
class _NoHostSync(TorchDispatchMode):
    """Fails on ops that read tensor data on the host or have data-dependent shapes."""

    forbidden = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "item")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        name = str(func)
        assert not any(f in name for f in self.forbidden), f"host-syncing op {name}"
        if "repeat_interleave" in name:
            assert kwargs.get("output_size") is not None, "repeat_interleave without output_size"
        return func(*args, **kwargs)


def test_batched_functions_never_sync_with_the_host(dd: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    logits = torch.randn(3, 6, 80)
    picks = torch.randint(0, 80, (3, 33))
    for method in ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, method, lambda *a, _m=method, **k: pytest.fail(f"Tensor.{_m} called"))
    with _NoHostSync():
        batch = dd.build_ddtree_batch(logits, 32)
        dd.follow_verified_tree_batch(batch, picks)
        dd.tree_links(batch)
        dd.tree_positions(batch, torch.tensor([4, 5, 6]))
        dd.tree_attention_mask(batch, 7)
    monkeypatch.undo()
    assert batch.num_nodes.tolist() == [32, 32, 32]


def test_the_newest_core_never_diverges_silently(dd: ModuleType) -> None:
    """The newest core replays one rounding event per depth; a tree that needs more is flagged."""
    rng = torch.Generator().manual_seed(1)
    for trial in range(40):
        logits = engineered_rounding_logits(rng)
        budget = [60, 150, 400, 2000][trial % 4]
        batch = dd.build_ddtree_batch(logits[None], budget)
        single = dd.build_ddtree_tree(logits, budget)
        same = all(torch.equal(getattr(single, f), getattr(batch.tree(0), f)) for f in ("tokens", "parents", "scores"))
        assert same or not bool(batch.scores_exact[0]), trial
