"""Overlay ddtree 0.3.0-rc.1 on GDN hybrids: the tree links the verify carries, as SGLang's tree
conv kernel reads them (``causal_conv1d_triton.py``, 0.5.17: for t in token order,
``parent[next[t]] = t`` then ``parent[sib[t]] = parent[t]``; unset parents stay 0, the root).
The rule needs every parent and previous sibling at a smaller index than the node it
links; these tests show that DDTree's pop order gives exactly the tree's parents, with the
padding nodes of a batch resolving to the root."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from tests.ddtree.test_hybrid_rules import hybrid_module


@pytest.fixture(scope="module")
def hybrid() -> ModuleType:
    return hybrid_module()


def kernel_parents(next_token: torch.Tensor, next_sibling: torch.Tensor) -> torch.Tensor:
    """The conv kernel's parent derivation, transcribed (one pass in token order)."""
    bs, width = next_token.shape
    parent = torch.zeros((bs, width), dtype=torch.int64)
    rows = torch.arange(bs)
    for t in range(width):
        child, sibling = next_token[:, t], next_sibling[:, t]
        linked = child != -1
        parent[rows[linked], child[linked]] = t
        linked = sibling != -1
        parent[rows[linked], sibling[linked]] = parent[rows[linked], t]
    return parent


def trees(dd: ModuleType, budget: int, seed: int, vocab: int = 40, depth: int = 7):
    """A batch of 4 trees: random logits, tie-heavy logits, a near-certain draft and
    masked vocabulary (fewer nodes than the budget, so padding nodes)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn((4, depth, vocab), generator=g) * 3.0
    logits[1] = torch.randint(0, 3, (depth, vocab), generator=g).float()  # many exact ties
    logits[2, :, 0] += 30.0  # the rank-0 chain pops first
    logits[3, :, 2:] = float("-inf")  # 2 tokens per depth: 254 nodes at most
    return dd.build_ddtree_batch(logits, budget)


@pytest.mark.parametrize("budget", [7, 16, 64, 256])
def test_kernel_parent_rule_on_ddtree_links_gives_the_trees_parents(
    dd: ModuleType, hybrid: ModuleType, budget: int
) -> None:
    nodes = 0
    for seed in range(8):
        tree = trees(dd, budget, seed)
        _, next_token, next_sibling = dd.tree_links(tree)
        width = budget + 1
        index = torch.arange(width).expand_as(next_token)
        # Every link points forward: children and next siblings come later in pop order.
        assert bool(((next_token == -1) | (next_token > index)).all())
        assert bool(((next_sibling == -1) | (next_sibling > index)).all())
        derived = kernel_parents(next_token, next_sibling)
        assert torch.equal(derived, hybrid.ddtree_link_parents(tree.parents))
        real = index[:, 1:] <= tree.num_nodes[:, None]
        assert torch.equal(derived[:, 1:][real], tree.parents[:, 1:][real])  # the tree's own parents
        assert bool((derived[:, 1:][~real] == 0).all())  # padding resolves to the root
        nodes += int(tree.num_nodes.sum())
    assert nodes >= 8 * 3 * min(budget, 7)


def test_padding_exists_in_the_masked_tree(dd: ModuleType) -> None:
    """The masked-vocabulary row really has fewer nodes than the budget (so the padding
    branch of the test above is exercised)."""
    tree = trees(dd, 256, 0)
    assert int(tree.num_nodes[3]) < 256 and int(tree.num_nodes[0]) == 256


def test_links_layout_is_sglangs(dd: ModuleType) -> None:
    """The example of the kernel's own comment: 0 -> (1, 2), 1 -> 3."""
    tiny = dd.DDTree(tokens=torch.tensor([5, 6, 7]), depths=torch.tensor([1, 1, 2]),
                     parents=torch.tensor([-1, 0, 0, 1]), visibility=torch.eye(4, dtype=torch.bool),
                     scores=torch.tensor([-0.1, -0.5, -0.7]), child_map={}, budget=3)
    _, next_token, next_sibling = dd.tree_links(tiny)
    assert next_token.tolist() == [1, 3, -1, -1]
    assert next_sibling.tolist() == [-1, 2, -1, -1]
    assert kernel_parents(next_token[None], next_sibling[None]).tolist() == [[0, 0, 0, 1]]
