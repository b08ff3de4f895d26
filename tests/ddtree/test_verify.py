"""Verify inputs (positions, mask, SGLang links), the verify walk and the tree metrics."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest
import torch

MakeLogits = Callable[[str, tuple[int, ...], int], torch.Tensor]


@pytest.fixture
def batch(dd: ModuleType, make_logits: MakeLogits) -> object:
    # Mixed shapes: a bushy tree, a masked (small) one, a sharp chain-like one.
    logits = torch.cat(
        [
            make_logits("flat", (1, 5, 30), 1),
            make_logits("masked", (1, 5, 30), 2),
            make_logits("sharp", (1, 5, 30), 3),
        ]
    )
    return dd.build_ddtree_batch(logits, 24)


def ancestors(parents: list[int], node: int) -> set[int]:
    seen = {node}
    while parents[node] >= 0:
        node = parents[node]
        seen.add(node)
    return seen


def test_positions_are_start_plus_depth(dd: ModuleType, batch: object) -> None:
    start = torch.tensor([5, 0, 17])
    positions = dd.tree_positions(batch, start)
    assert positions.shape == (3, 25)
    for b in range(3):
        tree = batch.tree(b)
        single = dd.tree_positions(tree, int(start[b]))
        assert single.tolist() == [int(start[b])] + [int(start[b]) + d for d in tree.depths.tolist()]
        assert torch.equal(positions[b, : tree.num_nodes + 1], single)


def test_mask_sees_the_prefix_and_only_ancestors_inside_the_tree(dd: ModuleType, batch: object) -> None:
    mask = dd.tree_attention_mask(batch, 4)
    assert mask.shape == (3, 25, 29) and mask[:, :, :4].all()
    for b in range(3):
        tree = batch.tree(b)
        parents = tree.parents.tolist()
        single = dd.tree_attention_mask(tree, 4)
        for i in range(tree.num_nodes + 1):
            assert set(torch.nonzero(single[i, 4:]).flatten().tolist()) == ancestors(parents, i)
        n = tree.num_nodes + 1
        assert torch.equal(mask[b, :n, : 4 + n], single)
    with pytest.raises(ValueError, match="prefix_len"):
        dd.tree_attention_mask(batch, -1)


def test_links_encode_the_parents(dd: ModuleType, batch: object) -> None:
    index, first_child, next_sibling = dd.tree_links(batch)
    assert torch.equal(index, torch.arange(3 * 25).view(3, 25))
    for b in range(3):
        tree = batch.tree(b)
        parents = tree.parents.tolist()
        children: dict[int, list[int]] = {}
        for node in range(tree.num_nodes + 1):
            kids = []
            child = int(first_child[b, node])
            while child != -1:
                kids.append(child)
                child = int(next_sibling[b, child])
            children[node] = kids
        expected = {node: [i for i in range(1, len(parents)) if parents[i] == node] for node in children}
        assert children == expected
        # Padding nodes are never linked.
        assert (first_child[b, tree.num_nodes + 1 :] == -1).all()
        assert (next_sibling[b, tree.num_nodes + 1 :] == -1).all()
        single = dd.tree_links(tree)
        n = tree.num_nodes + 1
        assert torch.equal(single[1], first_child[b, :n]) and torch.equal(single[2], next_sibling[b, :n])


def sglang_verify_tree_greedy(
    candidates: torch.Tensor,
    index: torch.Tensor,
    first_child: torch.Tensor,
    next_sibling: torch.Tensor,
    picks: torch.Tensor,
) -> tuple[list[int], list[list[int]]]:
    """Python transcription of SGLang 0.5.17's verify_tree_greedy kernel (spec_tree.py)."""
    bs, n = candidates.shape
    flat_picks = picks.reshape(-1).tolist()
    counts, paths = [], []
    for b in range(bs):
        last = int(index[b, 0])
        path, cur = [last], 0
        while True:
            cur = int(first_child[b, cur])
            target = flat_picks[last]
            while cur != -1 and int(candidates[b, cur]) != target:
                cur = int(next_sibling[b, cur])
            if cur == -1:
                break
            last = int(index[b, cur])
            path.append(last)
        counts.append(len(path) - 1)
        paths.append(path)
    return counts, paths


def picks_that_follow(tree: object, b: int, gen: torch.Generator, vocab: int) -> torch.Tensor:
    """Target picks that follow the tree for a while (often through a non-first child)."""
    picks = torch.randint(0, vocab, (tree.parents.shape[1],), generator=gen)
    children: dict[int, list[int]] = {}
    for i in range(1, int(tree.num_nodes[b]) + 1):
        children.setdefault(int(tree.parents[b, i]), []).append(i)
    node = 0
    while children.get(node) and torch.rand(1, generator=gen).item() < 0.85:
        kids = children[node]
        child = kids[int(torch.randint(0, len(kids), (1,), generator=gen))]
        picks[node] = tree.tokens[b, child - 1]
        node = child
    return picks


def test_batched_walk_equals_the_single_walk_and_sglang(dd: ModuleType, batch: object) -> None:
    gen = torch.Generator().manual_seed(5)
    index, first_child, next_sibling = dd.tree_links(batch)
    candidates = torch.cat([torch.full((3, 1), -1), batch.tokens], dim=1)
    for _ in range(30):
        picks = torch.stack([picks_that_follow(batch, b, gen, 30) for b in range(3)])
        lengths, paths = dd.follow_verified_tree_batch(batch, picks)
        assert paths.shape == (3, batch.max_depth + 1)
        counts, flat_paths = sglang_verify_tree_greedy(candidates, index, first_child, next_sibling, picks)
        for b in range(3):
            accepted, next_token = dd.follow_verified_tree(batch.tree(b), picks[b, : int(batch.num_nodes[b]) + 1])
            length = int(lengths[b])
            assert length == len(accepted) == counts[b] + 1
            assert paths[b, :length].tolist() == accepted.tolist()
            assert (paths[b, length:] == accepted[-1]).all()  # padded with the last accepted node
            assert next_token == int(picks[b, accepted[-1]])
            assert [i - b * 25 for i in flat_paths[b]] == accepted.tolist()


def test_walk_accepts_token_zero_and_ignores_padding(dd: ModuleType) -> None:
    logits = torch.full((1, 3, 5), float("-inf"))
    logits[..., 0] = 0.0  # a chain of token 0, then padding (token 0 too) under the root
    tree = dd.build_ddtree_batch(logits, 6)
    assert tree.num_nodes.tolist() == [3] and tree.tokens[0].tolist() == [0] * 6
    lengths, paths = dd.follow_verified_tree_batch(tree, torch.zeros((1, 7), dtype=torch.int64))
    assert lengths.tolist() == [4] and paths[0].tolist() == [0, 1, 2, 3]


def summary_case(dd: ModuleType) -> tuple[object, torch.Tensor, torch.Tensor]:
    """A 7-node tree with two near-equal tokens per depth, picks that accept two nodes, and the path."""
    logits = torch.zeros(3, 10)
    logits[:, 4] = 3.0
    logits[:, 6] = 2.9
    tree = dd.build_ddtree_tree(logits, 7)
    picks = torch.tensor([4, 6] + [9] * 6)
    accepted, _ = dd.follow_verified_tree(tree, picks)
    return tree, accepted, picks


def test_summary_and_prefix_closed_check(dd: ModuleType) -> None:
    tree, accepted, _ = summary_case(dd)
    summary = dd.summarize_ddtree(tree, accepted)
    assert summary["budget"] == 7 and summary["nodes"] == 7
    assert summary["nodes_per_depth"] == [2, 4, 1] and summary["max_depth"] == 3
    assert summary["leaves"] == 4 and summary["max_branching"] == 2
    assert summary["accepted_nodes"] == 2 and summary["accepted_depth"] == 2 and summary["accept_length"] == 3
    dd.assert_prefix_closed(tree)
    broken = dd.DDTree(**{**tree.__dict__, "parents": torch.tensor([-1, 0, 0, 1, 5, 2, 2, 3])})
    with pytest.raises(AssertionError, match="node 4: parent 5"):
        dd.assert_prefix_closed(broken)
    broken = dd.DDTree(**{**tree.__dict__, "visibility": torch.eye(8, dtype=torch.bool)})
    with pytest.raises(AssertionError, match="visibility"):
        dd.assert_prefix_closed(broken)


def test_010s_summary_has_the_top1_agreement_along_the_path(dd010: ModuleType) -> None:
    """0.1.0's summary takes the target's picks (the newest core has `draft_top1_agreement`, test_round.py)."""
    tree, accepted, picks = summary_case(dd010)
    summary = dd010.summarize_ddtree(tree, accepted, picks)
    assert summary["accepted_nodes"] == 2 and summary["accept_length"] == 3
    # Depth 1: the target took the draft's top token (4); depth 2: the runner-up (6), a leaf.
    assert summary["top1_agreement"] == [True, False]
