"""DDTREE Triton kernels: the best-first draft tree of every request in one program.

``ddtree_utils.build_ddtree_batch`` takes the top-K log-probs of every depth in torch,
then, on CUDA, hands them to ``build_ddtree_trees_triton``: one program per request runs
the reference heap's pop loop (DDTREE.md, "Build the tree") with its frontier held in
registers, and a second kernel writes the ancestor-or-self matrix. The torch builder
beside it stays the reference (and the CPU path); the trees are the same, bit for bit.

The frontier. A popped node pushes its next sibling and its first child, so every node
(the root included) has at most one child waiting in the frontier at a time. Slot ``i``
of the frontier is that pending child of node ``i``: popping the entry of slot ``p`` as
node ``n`` puts its next sibling back into slot ``p`` and its first child into slot
``n``. No slot is ever allocated or freed.

Ties. The heap pops equal scores in lexicographic order of the rank paths. For two
pending entries with parents ``a`` and ``b`` that order is the post-order of ``a`` and
``b`` in the tree popped so far (a pending child of a descendant of ``a`` sorts before
the pending child of ``a``, whose earlier children are all popped; otherwise the paths
part where the parents' paths part). A new node is a leaf and the last child of its
parent so far, so it enters the post-order right before its parent: each slot keeps its
parent's post-order position, and a pop shifts the positions from the parent's on by
one. The pop is then the max of (score, then smallest key) over the block: one reduction
with its own combine on the GPU (a quarter faster on the H200 than a max followed by a
min over the maxima's keys). Triton's interpreter runs such a combine element by
element, so there (the CPU tests) the kernel takes the two plain reductions instead;
the tests run both.
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

# Fields of a slot's packed int64 key, low to high: the pending child's depth, its rank,
# the slot (= its parent node), the parent's post-order position. The smallest key among
# equal scores is the heap's next pop.
_DEPTH_BITS = 8
_FIELD_BITS = 16
_RANK_SHIFT = _DEPTH_BITS
_SLOT_SHIFT = _RANK_SHIFT + _FIELD_BITS
_POS_SHIFT = _SLOT_SHIFT + _FIELD_BITS


@triton.jit
def _ddtree_finite(x):
    return (x > float("-inf")) & (x < float("inf"))


@triton.jit
def _ddtree_better(score_a, key_a, score_b, key_b):
    take_a = (score_a > score_b) | ((score_a == score_b) & (key_a < key_b))
    return tl.where(take_a, score_a, score_b), tl.where(take_a, key_a, key_b)


@triton.jit
def _ddtree_pop(score, key, ONE_REDUCTION: tl.constexpr):
    """The best (score, key) of the frontier: highest score, then smallest key."""
    if ONE_REDUCTION:
        best, win = tl.reduce((score, key), 0, _ddtree_better)
    else:
        best = tl.max(score, axis=0)
        win = tl.min(tl.where(score == best, key, 0x7FFFFFFFFFFFFFFF), axis=0)
    return best, win


@triton.jit
def _ddtree_build_kernel(
    log_probs_ptr,
    top_tokens_ptr,
    tokens_ptr,
    depths_ptr,
    parents_ptr,
    scores_ptr,
    num_nodes_ptr,
    budget,
    depth_limit,
    k,
    SLOTS: tl.constexpr,
    RANK_SHIFT: tl.constexpr,
    SLOT_SHIFT: tl.constexpr,
    POS_SHIFT: tl.constexpr,
    ONE_REDUCTION: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    row0 = log_probs_ptr + req * depth_limit * k
    top_tokens = top_tokens_ptr + req * depth_limit * k
    tokens_out = tokens_ptr + req * budget
    depths_out = depths_ptr + req * budget
    parents_out = parents_ptr + req * (budget + 1)
    scores_out = scores_ptr + req * budget

    neg_inf = float("-inf")
    slot = tl.arange(0, SLOTS).to(tl.int64)
    field = (1 << (SLOT_SHIFT - RANK_SHIFT)) - 1
    # Slot 0 holds the root's first child (depth 1, rank 0); the others are empty.
    first = tl.load(row0).to(tl.float64)
    first = tl.where(_ddtree_finite(first), first, neg_inf)
    score = tl.where(slot == 0, first, neg_inf)
    key = (slot << SLOT_SHIFT) + 1
    tl.store(parents_out, -1)
    count = 0
    for node in range(1, budget + 1):
        best, win = _ddtree_pop(score, key, ONE_REDUCTION)
        valid = best > neg_inf
        depth = win & ((1 << RANK_SHIFT) - 1)
        rank = (win >> RANK_SHIFT) & field
        parent = (win >> SLOT_SHIFT) & field
        parent_pos = win >> POS_SHIFT
        row = row0 + (depth - 1) * k
        has_next = valid & (rank + 1 < k)
        has_child = valid & (depth < depth_limit)
        own = tl.load(row + rank, mask=valid, other=0.0).to(tl.float64)
        following = tl.load(row + rank + 1, mask=has_next, other=neg_inf).to(tl.float64)
        child = tl.load(row0 + depth * k, mask=has_child, other=neg_inf).to(tl.float64)
        token = tl.load(top_tokens + (depth - 1) * k + rank, mask=valid, other=0)

        tl.store(tokens_out + node - 1, token)
        tl.store(depths_out + node - 1, tl.where(valid, depth, 1))
        tl.store(parents_out + node, tl.where(valid, parent, 0))
        tl.store(scores_out + node - 1, best)
        count += valid.to(tl.int32)

        # The reference arithmetic, in this order: (score - logp[r]) + logp[r + 1].
        sibling = tl.where(_ddtree_finite(following), (best - own) + following, neg_inf)
        first_child = tl.where(_ddtree_finite(child), best + child, neg_inf)
        # The new node enters the post-order right before its parent. (Validity goes into
        # the scalars: the interpreter cannot broadcast a scalar comparison.)
        shift_from = tl.where(valid, parent_pos, 1 << 62)
        key = tl.where((key >> POS_SHIFT) >= shift_from, key + (1 << POS_SHIFT), key)
        at_parent = slot == tl.where(valid, parent, -1)
        at_node = slot == tl.where(valid, node, -1)
        score = tl.where(at_parent, sibling, score)
        key = tl.where(at_parent, key + (1 << RANK_SHIFT), key)
        score = tl.where(at_node, first_child, score)
        key = tl.where(
            at_node, (parent_pos << POS_SHIFT) + (slot << SLOT_SHIFT) + depth + 1, key
        )
    tl.store(num_nodes_ptr + req, count)


@triton.jit
def _ddtree_visibility_kernel(
    parents_ptr,
    visibility_ptr,
    width,
    max_depth,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
):
    # Row i of the ancestor-or-self matrix: walk i's parent pointers up to the root.
    req = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, COLS)
    parents = parents_ptr + req * width
    in_rows = rows < width
    visible = cols[None, :] == rows[:, None]
    ancestor = tl.load(parents + rows, mask=in_rows, other=-1)
    for _ in range(max_depth):
        visible = visible | (cols[None, :] == ancestor[:, None])
        ancestor = tl.load(parents + ancestor, mask=ancestor >= 0, other=-1)
    out = visibility_ptr + req * width * width + rows[:, None] * width + cols[None, :]
    tl.store(out, visible.to(tl.uint8), mask=in_rows[:, None] & (cols[None, :] < width))


def _ddtree_one_reduction() -> bool:
    """The pop's single reduction, except under Triton's interpreter (see the module docstring)."""
    return os.environ.get("TRITON_INTERPRET") != "1"


def build_ddtree_trees_triton(
    *,
    log_probs: torch.Tensor,
    top_tokens: torch.Tensor,
    budget: int,
    one_reduction: Optional[bool] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Best-first draft trees of a batch from its top-K log-probs, one program per request.

    Args:
        log_probs: Top-K T=1 log-probs of every depth, each row best first (ties by
            token id), as ``ddtree_utils._ddtree_top_k`` gives them. Shape: [bs, L, K],
            float32; L = min(draft depth, budget), K = min(budget, V).
        top_tokens: Their token ids. Shape: [bs, L, K], int64.
        budget: Nodes per tree, root excluded; 1 <= budget < 65536.
        one_reduction: The pop as one reduction (default: except under the interpreter);
            both ways give the same trees.

    Returns:
        (tokens [bs, budget], depths [bs, budget], parents [bs, budget + 1],
        visibility [bs, budget + 1, budget + 1] bool, scores [bs, budget] float64,
        num_nodes [bs]), with the padding of ``DDTreeBatch``: nodes past ``num_nodes``
        are token 0, depth 1, parent 0, score -inf.
    """
    bs, depth_limit, k = log_probs.shape
    if not 1 <= budget < 1 << _FIELD_BITS:
        raise ValueError(f"budget must be in [1, {1 << _FIELD_BITS}), got {budget}.")
    if not 1 <= depth_limit < 1 << _DEPTH_BITS or not 1 <= k <= budget:
        raise ValueError(f"log_probs must be [bs, 1..255, 1..budget], got {tuple(log_probs.shape)}.")
    if top_tokens.shape != log_probs.shape:
        raise ValueError(f"top_tokens must have shape {tuple(log_probs.shape)}, got {tuple(top_tokens.shape)}.")
    device = log_probs.device
    tokens = torch.empty((bs, budget), dtype=torch.int64, device=device)
    depths = torch.empty((bs, budget), dtype=torch.int64, device=device)
    parents = torch.empty((bs, budget + 1), dtype=torch.int64, device=device)
    scores = torch.empty((bs, budget), dtype=torch.float64, device=device)
    num_nodes = torch.empty((bs,), dtype=torch.int64, device=device)
    visibility = torch.empty((bs, budget + 1, budget + 1), dtype=torch.bool, device=device)
    if bs == 0:
        return tokens, depths, parents, visibility, scores, num_nodes
    slots = triton.next_power_of_2(budget)
    _ddtree_build_kernel[(bs,)](
        log_probs.contiguous(),
        top_tokens.contiguous(),
        tokens,
        depths,
        parents,
        scores,
        num_nodes,
        budget,
        depth_limit,
        k,
        SLOTS=slots,
        RANK_SHIFT=_RANK_SHIFT,
        SLOT_SHIFT=_SLOT_SHIFT,
        POS_SHIFT=_POS_SHIFT,
        ONE_REDUCTION=_ddtree_one_reduction() if one_reduction is None else one_reduction,
        # Measured on the H200 at budgets 64, 512 and 1024: one warp best at 64, four above.
        num_warps=1 if slots <= 64 else 4,
    )
    cols = triton.next_power_of_2(budget + 1)
    rows = max(1, min(16, 8192 // cols))
    _ddtree_visibility_kernel[(bs, triton.cdiv(budget + 1, rows))](
        parents, visibility.view(torch.uint8), budget + 1, depth_limit, ROWS=rows, COLS=cols
    )
    return tokens, depths, parents, visibility, scores, num_nodes
