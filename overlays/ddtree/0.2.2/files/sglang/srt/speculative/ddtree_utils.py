"""DDTree draft trees: best-first tree building, verification inputs, the verify walk and metrics.

DDTree (Ringel et al., 2026, "Accelerating Speculative Decoding with Block Diffusion Draft
Trees") turns one DFlash drafter pass, ``draft_logits[L, V]`` (row ``d - 1`` is depth ``d``),
into a tree of ``budget`` nodes that the target verifies in one forward pass. This module is
torch only (no sglang imports) so it can be tested on the CPU.

Semantics, shared by both builders:

- Log-probs are always taken at temperature 1: ``log_softmax(draft_logits.float())``. Every row
  keeps its top ``K = min(budget, V)`` tokens, ranked by log-prob and then by token id (the
  tie order is fixed so that every device and batch shape ranks the same way).
- A node is a path of ranks ``(r1, ..., rd)``; its score is the float64 sum of its log-probs,
  computed exactly as the reference best-first heap computes it: a first child scores
  ``parent + logp[d-1][0]``; the next sibling of a node scores
  ``(node - logp[d-1][r]) + logp[d-1][r + 1]``.
- The tree is the first ``budget`` nodes popped by that heap: higher score first, and on equal
  scores the lexicographically smaller rank tuple first. Tokens whose log-prob is ``-inf``
  (masked vocabulary) never become nodes, so a tree can have fewer than ``budget`` nodes.
  ``budget <= 0`` gives a root-only tree. Token id 0 is an ordinary token.
- Node 0 is the root (the last committed token); nodes ``1..n`` are drafts, parents before
  children.

``build_ddtree_tree`` runs the reference heap on the host for one request.
``build_ddtree_batch`` computes the same trees for a batch on the logits' device without any
host synchronisation and with static shapes for a given budget (CUDA-graph friendly).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F

__all__ = [
    "DDTree",
    "DDTreeBatch",
    "DDTreeCommit",
    "assert_prefix_closed",
    "build_ddtree_batch",
    "build_ddtree_tree",
    "ddtree_commit_plan",
    "ddtree_verify_inputs",
    "draft_top1_agreement",
    "follow_verified_tree",
    "follow_verified_tree_batch",
    "summarize_ddtree",
    "tree_attention_mask",
    "tree_links",
    "tree_positions",
]

# Sibling scores in the heap are computed from the previous sibling, so a float64 rounding in
# one step carries into the later siblings. The batch builder replays such roundings with this
# many correction passes per depth; more rounding events than that are reported through
# ``DDTreeBatch.scores_exact`` (none were seen on realistic logits: they need float64 sums
# whose bits span more than 53 binary digits).
_DDTREE_SIBLING_FOLD_PASSES = 1


@dataclass
class DDTree:
    """One request's draft tree; node 0 is the root, nodes 1..n are drafts in heap pop order."""

    # Draft token of nodes 1..n. Shape: [n], int64.
    tokens: torch.Tensor
    # Depth of nodes 1..n, 1-based (the root has depth 0). Shape: [n], int64.
    depths: torch.Tensor
    # Parent index of nodes 0..n; parents[0] == -1 and parents[i] < i. Shape: [n + 1], int64.
    parents: torch.Tensor
    # visibility[i, j]: node j is node i or one of its ancestors. Shape: [n + 1, n + 1], bool.
    visibility: torch.Tensor
    # Sum of the draft log-probs along each node's path. Shape: [n], float64.
    scores: torch.Tensor
    # (parent index, token) -> node index.
    child_map: Dict[Tuple[int, int], int]
    # The budget the tree was built for.
    budget: int

    @property
    def num_nodes(self) -> int:
        """Number of draft nodes, root excluded."""
        return int(self.tokens.shape[0])


@dataclass
class DDTreeBatch:
    """Draft trees of a batch, padded to ``budget`` nodes each.

    Request ``b`` has ``num_nodes[b]`` nodes at indices ``1..num_nodes[b]`` in heap pop order
    (the same order as ``build_ddtree_tree``). Padding nodes (indices above ``num_nodes[b]``)
    are leaves under the root with token 0, depth 1 and score ``-inf``; ``tree_links`` and
    ``follow_verified_tree_batch`` never reach them.
    """

    # Shape: [bs, budget], int64.
    tokens: torch.Tensor
    # Shape: [bs, budget], int64, 1-based.
    depths: torch.Tensor
    # Shape: [bs, budget + 1], int64; parents[:, 0] == -1.
    parents: torch.Tensor
    # Shape: [bs, budget + 1, budget + 1], bool.
    visibility: torch.Tensor
    # Shape: [bs, budget], float64; -inf on padding.
    scores: torch.Tensor
    # Shape: [bs], int64.
    num_nodes: torch.Tensor
    # False where a sibling score may differ from the heap's in the last bits (see
    # _DDTREE_SIBLING_FOLD_PASSES). Shape: [bs], bool.
    scores_exact: torch.Tensor
    budget: int
    # Deepest possible node: min(L, budget).
    max_depth: int

    def tree(self, index: int) -> DDTree:
        """Request ``index`` as a ``DDTree`` (copies to the host; for tests and debugging)."""
        n = int(self.num_nodes[index])
        parents = self.parents[index, : n + 1]
        tokens = self.tokens[index, :n]
        return DDTree(
            tokens=tokens,
            depths=self.depths[index, :n],
            parents=parents,
            visibility=self.visibility[index, : n + 1, : n + 1],
            scores=self.scores[index, :n],
            child_map=_ddtree_child_map(parents.tolist(), tokens.tolist()),
            budget=self.budget,
        )


AnyDDTree = Union[DDTree, DDTreeBatch]


# --------------------------------------------------------------------------- shared pieces
def _check_draft_logits(draft_logits: torch.Tensor, *, dims: int, budget: int) -> None:
    if draft_logits.dim() != dims:
        raise ValueError(
            f"draft_logits must have {dims} dimensions, got shape {tuple(draft_logits.shape)}."
        )
    if not draft_logits.is_floating_point():
        raise ValueError(f"draft_logits must be a float tensor, got {draft_logits.dtype}.")
    if draft_logits.shape[-1] == 0:
        raise ValueError("draft_logits must have a non-empty vocabulary dimension.")
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise ValueError(f"budget must be an int, got {budget!r}.")


def _ddtree_top_k(draft_logits: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` T=1 log-probs of every row, by log-prob then token id.

    Args:
        draft_logits: Shape: [..., V], any float dtype.
        k: 1 <= k <= V.

    Returns:
        (log_probs float32, tokens int64), both of shape [..., k].
    """
    # "+ 0.0" folds -0.0 into +0.0 so that equal log-probs get equal keys.
    log_probs = torch.log_softmax(draft_logits.float(), dim=-1) + 0.0
    bits = log_probs.view(torch.int32)
    # Order-preserving integer image of the float32 bits, then the token id (smaller first)
    # in the low 32 bits: one int64 key makes torch.topk's order total and device-independent.
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)
    vocab_ids = torch.arange(draft_logits.shape[-1], device=draft_logits.device)
    key = ordered * (1 << 32) + ((1 << 32) - 1 - vocab_ids)
    tokens = key.topk(k, dim=-1).indices
    return log_probs.gather(-1, tokens), tokens


def _ddtree_visibility(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """Ancestor-or-self matrix from a parents array.

    Args:
        parents: Shape: [bs, n + 1], parents[:, 0] == -1.
        max_depth: Upper bound on node depth (number of pointer hops).

    Returns:
        Shape: [bs, n + 1, n + 1], bool; row i is i and its ancestors.
    """
    bs, width = parents.shape
    visibility = (
        torch.eye(width, dtype=torch.bool, device=parents.device)
        .expand(bs, width, width)
        .clone()
    )
    nodes = torch.arange(width, device=parents.device).expand(bs, width)
    ancestor = parents
    for _ in range(max_depth):
        has_ancestor = ancestor >= 0
        # Nodes already at the root write their own (already set) diagonal cell.
        column = torch.where(has_ancestor, ancestor, nodes)
        visibility.scatter_(2, column.unsqueeze(-1), True)
        ancestor = torch.where(
            has_ancestor, parents.gather(1, ancestor.clamp(min=0)), ancestor
        )
    return visibility


def _ddtree_child_map(parents: List[int], tokens: List[int]) -> Dict[Tuple[int, int], int]:
    return {(parents[i + 1], token): i + 1 for i, token in enumerate(tokens)}


def _as_batch(tensor: torch.Tensor, tree: AnyDDTree) -> torch.Tensor:
    return tensor.unsqueeze(0) if isinstance(tree, DDTree) else tensor


def _as_tree_shape(tensor: torch.Tensor, tree: AnyDDTree) -> torch.Tensor:
    return tensor.squeeze(0) if isinstance(tree, DDTree) else tensor


def _num_nodes_tensor(tree: AnyDDTree) -> torch.Tensor:
    if isinstance(tree, DDTree):
        return torch.tensor([tree.num_nodes], device=tree.parents.device)
    return tree.num_nodes


# --------------------------------------------------------------------------- single request
def build_ddtree_tree(draft_logits: torch.Tensor, budget: int) -> DDTree:
    """Build one request's draft tree with the reference best-first heap.

    Args:
        draft_logits: Drafter logits of the block's mask positions; row d-1 is depth d.
            Shape: [L, V], any float dtype, any device.
        budget: Number of draft nodes, root excluded; <= 0 gives a root-only tree.

    Returns:
        A ``DDTree`` on the logits' device, nodes in pop order.

    Notes:
        Runs on the host (it copies the top-K log-probs there). Use ``build_ddtree_batch``
        inside a decode round.
    """
    _check_draft_logits(draft_logits, dims=2, budget=budget)
    depth_limit, vocab_size = draft_logits.shape
    device = draft_logits.device
    tokens: List[int] = []
    depths: List[int] = []
    parents: List[int] = [-1]
    scores: List[float] = []
    if budget > 0 and depth_limit > 0:
        top_log_probs, top_tokens = _ddtree_top_k(draft_logits, min(budget, vocab_size))
        log_probs: List[List[float]] = top_log_probs.double().tolist()
        token_ids: List[List[int]] = top_tokens.tolist()
        _ddtree_heap(log_probs, token_ids, budget, tokens, depths, parents, scores)
    parents_tensor = torch.tensor(parents, dtype=torch.int64, device=device)
    return DDTree(
        tokens=torch.tensor(tokens, dtype=torch.int64, device=device),
        depths=torch.tensor(depths, dtype=torch.int64, device=device),
        parents=parents_tensor,
        visibility=_ddtree_visibility(parents_tensor[None], max(depths, default=0))[0],
        scores=torch.tensor(scores, dtype=torch.float64, device=device),
        child_map=_ddtree_child_map(parents, tokens),
        budget=budget,
    )


def _ddtree_heap(
    log_probs: List[List[float]],
    token_ids: List[List[int]],
    budget: int,
    tokens: List[int],
    depths: List[int],
    parents: List[int],
    scores: List[float],
) -> None:
    """The reference best-first expansion; appends popped nodes to the output lists."""
    depth_limit, k = len(log_probs), len(log_probs[0])
    # Entry: (-score, rank path, parent index, depth, rank, score). The rank path breaks
    # score ties lexicographically, as the reference does.
    heap: List[Tuple[float, Tuple[int, ...], int, int, int, float]] = []
    if math.isfinite(log_probs[0][0]):
        heap.append((-log_probs[0][0], (0,), 0, 1, 0, log_probs[0][0]))
    while heap and len(tokens) < budget:
        _, ranks, parent, depth, rank, score = heapq.heappop(heap)
        node = len(tokens) + 1
        tokens.append(token_ids[depth - 1][rank])
        depths.append(depth)
        parents.append(parent)
        scores.append(score)
        row = log_probs[depth - 1]
        # -inf log-probs (masked vocabulary) are never pushed: they would score -inf, and the
        # sibling formula would turn them into NaN one step later.
        if rank + 1 < k and math.isfinite(row[rank + 1]):
            sibling = score - row[rank] + row[rank + 1]
            heapq.heappush(
                heap, (-sibling, ranks[:-1] + (rank + 1,), parent, depth, rank + 1, sibling)
            )
        if depth < depth_limit and math.isfinite(log_probs[depth][0]):
            child = score + log_probs[depth][0]
            heapq.heappush(heap, (-child, ranks + (0,), node, depth + 1, 0, child))


# --------------------------------------------------------------------------- batch builder
@dataclass
class _CandidateLayout:
    """Static (frontier slot, rank) pairs that can still be in the top ``budget``.

    Frontier slots are sorted best first and ranks are sorted best first, so the candidate
    (p, r) is beaten by every (p', r') with p' <= p and r' <= r: only (p + 1)(r + 1) <= budget
    can be selected. That keeps O(budget log budget) candidates per depth instead of
    budget * K.
    """

    parent_slot: torch.Tensor  # [P], frontier slot of each candidate
    rank: torch.Tensor  # [P], rank of each candidate in its row
    first: torch.Tensor  # [W], index of slot p's rank-0 candidate
    count: torch.Tensor  # [W], number of ranks kept for slot p
    size: int


def _ddtree_layout_sizes(width: int, k: int, budget: int) -> List[int]:
    return [min(k, budget // (slot + 1)) for slot in range(width)]


def _ddtree_candidate_layout(
    *, width: int, k: int, budget: int, device: torch.device
) -> _CandidateLayout:
    # Built from device ops only (no host-to-device copy) so that it can be captured.
    slots = torch.arange(width, device=device)
    count = torch.clamp(budget // (slots + 1), max=k)
    size = sum(_ddtree_layout_sizes(width, k, budget))
    first = torch.cumsum(count, 0) - count
    parent_slot = torch.repeat_interleave(slots, count, output_size=size)
    rank = torch.arange(size, device=device) - first[parent_slot]
    return _CandidateLayout(parent_slot, rank, first, count, size)


def _ddtree_segment_min(
    values: torch.Tensor, layout: _CandidateLayout, width: int, fill: int
) -> torch.Tensor:
    """Per frontier slot minimum of ``values`` [bs, P], broadcast back to [bs, P]."""
    bs = values.shape[0]
    index = layout.parent_slot.expand(bs, layout.size)
    out = torch.full((bs, width), fill, dtype=values.dtype, device=values.device)
    out.scatter_reduce_(1, index, values, reduce="amin", include_self=True)
    return out.gather(1, index)


def _ddtree_sibling_scores(
    parent_scores: torch.Tensor,
    log_probs: torch.Tensor,
    layout: _CandidateLayout,
    width: int,
    k: int,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Candidate scores with the heap's float64 arithmetic.

    The heap scores rank r of a parent with score s by the fold
    ``t0 = s + l0; t(j+1) = (t(j) - l(j)) + l(j+1)``. Writing ``u(j) = t(j) - l(j)`` gives
    ``t(j+1) = u(j) + l(j+1)``: while ``u`` stays equal to ``s`` the fold is the closed form
    ``s + l(r)``. A rounding "event" at rank j changes ``u`` for all later ranks; each pass
    finds the first event of every parent and recomputes the ranks after it.

    Args:
        parent_scores, log_probs: Shape: [bs, P], float64, in layout order.

    Returns:
        (scores [bs, P], exact [bs]): exact is False where an event was left unreplayed.
    """
    u = parent_scores
    scores = u + log_probs
    start = torch.zeros_like(layout.rank)
    rank = layout.rank.expand_as(scores)
    last_rank = (layout.count[layout.parent_slot] - 1).expand_as(scores)
    for _ in range(_DDTREE_SIBLING_FOLD_PASSES):
        back = scores - log_probs
        event = (back != u) & torch.isfinite(scores) & (rank >= start) & (rank < last_rank)
        first_event = _ddtree_segment_min(torch.where(event, rank, k), layout, width, k)
        later = rank > first_event
        event_at = layout.first[layout.parent_slot] + first_event.clamp(max=k - 1)
        u = torch.where(later, back.gather(1, event_at.clamp(max=layout.size - 1)), u)
        scores = torch.where(later, u + log_probs, scores)
        start = torch.where(first_event < k, first_event + 1, start)
    back = scores - log_probs
    event = (back != u) & torch.isfinite(scores) & (rank >= start) & (rank < last_rank)
    return scores, ~event.any(dim=1)


def _ddtree_root_only_batch(bs: int, budget: int, device: torch.device) -> DDTreeBatch:
    width = max(budget, 0)
    parents = torch.zeros((bs, width + 1), dtype=torch.int64, device=device)
    parents[:, 0] = -1
    return DDTreeBatch(
        tokens=torch.zeros((bs, width), dtype=torch.int64, device=device),
        depths=torch.ones((bs, width), dtype=torch.int64, device=device),
        parents=parents,
        visibility=_ddtree_visibility(parents, 1),
        scores=torch.full((bs, width), -math.inf, dtype=torch.float64, device=device),
        num_nodes=torch.zeros((bs,), dtype=torch.int64, device=device),
        scores_exact=torch.ones((bs,), dtype=torch.bool, device=device),
        budget=budget,
        max_depth=0,
    )


def build_ddtree_batch(draft_logits: torch.Tensor, budget: int) -> DDTreeBatch:
    """Build the draft trees of a batch on the logits' device, without host synchronisation.

    Args:
        draft_logits: Shape: [bs, L, V], any float dtype, any device.
        budget: Number of draft nodes per request, root excluded (static per CUDA graph).

    Returns:
        A ``DDTreeBatch`` padded to ``budget`` nodes; request b holds the same nodes, in the
        same order, as ``build_ddtree_tree(draft_logits[b], budget)``.

    Notes:
        Scores fall along every path, so the top ``budget`` nodes of depth d are children of
        the top ``budget`` nodes of depth d-1: one frontier of width ``budget`` per depth is
        enough (a Python loop over L, nothing data dependent). The frontier is ordered by
        (score desc, rank path asc); the per-depth frontiers are then merged in that order,
        which is the heap's pop order. Equality with the heap assumes scores above -3.7e8
        (below that a float64 sibling step can round up by one ulp and reorder exact ties).
    """
    _check_draft_logits(draft_logits, dims=3, budget=budget)
    bs, length, vocab_size = draft_logits.shape
    device = draft_logits.device
    depth_limit = min(length, max(budget, 0))
    if depth_limit == 0:
        return _ddtree_root_only_batch(bs, budget, device)
    k = min(budget, vocab_size)
    top_log_probs, top_tokens = _ddtree_top_k(draft_logits[:, :depth_limit], k)
    log_probs = top_log_probs.double()

    # Rank paths packed into int64 words (rank + 1 per depth, 0 past the node's depth, most
    # significant depth first): comparing words compares rank paths lexicographically.
    bits = k.bit_length()
    per_word = 63 // bits
    num_words = -(-depth_limit // per_word)

    widths = [1]
    for _ in range(depth_limit):
        widths.append(min(budget, sum(_ddtree_layout_sizes(widths[-1], k, budget))))
    total = sum(widths[1:])
    root_uid = total

    frontier_scores = torch.zeros((bs, 1), dtype=torch.float64, device=device)
    frontier_lex = torch.zeros((bs, 1), dtype=torch.int64, device=device)
    frontier_words = torch.zeros((bs, 1, num_words), dtype=torch.int64, device=device)
    frontier_uid = torch.full((bs, 1), root_uid, dtype=torch.int64, device=device)
    exact = torch.ones((bs,), dtype=torch.bool, device=device)
    level_scores: List[torch.Tensor] = []
    level_words: List[torch.Tensor] = []
    level_tokens: List[torch.Tensor] = []
    level_parents: List[torch.Tensor] = []
    offset = 0
    for depth in range(1, depth_limit + 1):
        width = widths[depth]
        layout = _ddtree_candidate_layout(
            width=widths[depth - 1], k=k, budget=budget, device=device
        )
        parent_scores = frontier_scores[:, layout.parent_slot]
        cand_log_probs = log_probs[:, depth - 1, layout.rank]
        if depth == 1:
            # The root scores 0.0, so every sibling step is exact.
            scores = parent_scores + cand_log_probs
        else:
            scores, level_exact = _ddtree_sibling_scores(
                parent_scores, cand_log_probs, layout, widths[depth - 1], k
            )
            exact = exact & level_exact
        scores = torch.where(torch.isfinite(scores), scores, -math.inf)

        # Order candidates by (score desc, rank path asc): sort by the path key, then stably
        # by score. The path key of (slot, r) is the parent's path position * K + r.
        lex = frontier_lex[:, layout.parent_slot] * k + layout.rank
        lex_order = lex.sort(dim=1).indices
        by_score = scores.gather(1, lex_order).sort(dim=1, descending=True, stable=True)
        pick = lex_order.gather(1, by_score.indices[:, :width])
        lex_position = torch.empty_like(lex_order).scatter_(
            1, lex_order, torch.arange(layout.size, device=device).expand(bs, layout.size)
        )
        pick_slot = layout.parent_slot[pick]
        pick_rank = layout.rank[pick]

        frontier_scores = by_score.values[:, :width]
        frontier_lex = lex_position.gather(1, pick)
        words = frontier_words.gather(
            1, pick_slot.unsqueeze(-1).expand(bs, width, num_words)
        )
        shift = (per_word - 1 - (depth - 1) % per_word) * bits
        words[:, :, (depth - 1) // per_word] += (pick_rank + 1) << shift
        frontier_words = words
        level_scores.append(frontier_scores)
        level_words.append(words)
        level_tokens.append(top_tokens[:, depth - 1].gather(1, pick_rank))
        level_parents.append(frontier_uid.gather(1, pick_slot))
        frontier_uid = (offset + torch.arange(width, device=device)).expand(bs, width)
        offset += width

    return _ddtree_merge_levels(
        scores=torch.cat(level_scores, dim=1),
        words=torch.cat(level_words, dim=1),
        tokens=torch.cat(level_tokens, dim=1),
        parent_uids=torch.cat(level_parents, dim=1),
        depths=torch.cat(
            [torch.full((w,), d, device=device) for d, w in enumerate(widths[1:], 1)]
        ),
        exact=exact,
        budget=budget,
        max_depth=depth_limit,
    )


def _ddtree_merge_levels(
    *,
    scores: torch.Tensor,
    words: torch.Tensor,
    tokens: torch.Tensor,
    parent_uids: torch.Tensor,
    depths: torch.Tensor,
    exact: torch.Tensor,
    budget: int,
    max_depth: int,
) -> DDTreeBatch:
    """Take the first ``budget`` frontier nodes of all depths in heap pop order.

    Args:
        scores, tokens, parent_uids: Shape: [bs, N]; node uid = column (the root is N).
        words: Packed rank paths. Shape: [bs, N, num_words].
        depths: Shape: [N].
    """
    bs, total = scores.shape
    device = scores.device
    # LSD sort: rank path words from least to most significant, then score; stable sorts
    # leave equal scores in rank path order.
    order = torch.arange(total, device=device).expand(bs, total)
    for w in reversed(range(words.shape[2])):
        order = order.gather(1, words[:, :, w].gather(1, order).sort(dim=1, stable=True).indices)
    by_score = scores.gather(1, order).sort(dim=1, descending=True, stable=True)
    n_out = min(budget, total)
    selected = order.gather(1, by_score.indices[:, :n_out])
    selected_scores = by_score.values[:, :n_out]
    valid = torch.isfinite(selected_scores)

    position = torch.zeros((bs, total + 1), dtype=torch.int64, device=device)
    position.scatter_(
        1, selected, torch.arange(1, n_out + 1, device=device).expand(bs, n_out)
    )
    # Every selected node's parent is selected (or is the root, whose position stays 0).
    node_parents = position.gather(1, parent_uids.gather(1, selected))

    pad = budget - n_out
    out_tokens = F.pad(torch.where(valid, tokens.gather(1, selected), 0), (0, pad))
    out_depths = F.pad(torch.where(valid, depths[selected], 1), (0, pad), value=1)
    out_scores = F.pad(selected_scores, (0, pad), value=-math.inf)
    parents = F.pad(torch.where(valid, node_parents, 0), (1, pad))
    parents[:, 0] = -1
    return DDTreeBatch(
        tokens=out_tokens,
        depths=out_depths,
        parents=parents,
        visibility=_ddtree_visibility(parents, max_depth),
        scores=out_scores,
        num_nodes=valid.sum(dim=1),
        scores_exact=exact,
        budget=budget,
        max_depth=max_depth,
    )


# --------------------------------------------------------------------------- verify inputs
def tree_positions(tree: AnyDDTree, start: Union[int, torch.Tensor]) -> torch.Tensor:
    """Rotary positions of ``[root] + nodes``: the root at ``start``, node i at start + depth.

    Args:
        tree: A ``DDTree`` or ``DDTreeBatch``.
        start: The root's own position. An int, or a [bs] tensor for a batch.

    Returns:
        Shape: [n + 1] for a tree, [bs, budget + 1] for a batch; int64.
    """
    depths = F.pad(_as_batch(tree.depths, tree), (1, 0))
    start_tensor = torch.as_tensor(start, dtype=torch.int64, device=depths.device)
    return _as_tree_shape(start_tensor.reshape(-1, 1) + depths, tree)


def tree_attention_mask(tree: AnyDDTree, prefix_len: int) -> torch.Tensor:
    """Attention mask of the verify pass: every tree row sees the whole committed prefix and,
    inside the tree, only itself and its ancestors.

    Args:
        tree: A ``DDTree`` or ``DDTreeBatch``.
        prefix_len: Number of committed KV entries before the root (same for the batch).

    Returns:
        Shape: [n + 1, prefix_len + n + 1] (or [bs, budget + 1, prefix_len + budget + 1]);
        bool, True = may attend.
    """
    if prefix_len < 0:
        raise ValueError(f"prefix_len must be non-negative, got {prefix_len}.")
    visibility = _as_batch(tree.visibility, tree)
    bs, width, _ = visibility.shape
    prefix = torch.ones((bs, width, prefix_len), dtype=torch.bool, device=visibility.device)
    return _as_tree_shape(torch.cat([prefix, visibility], dim=2), tree)


def tree_links(tree: AnyDDTree) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """First-child / next-sibling links in the layout of SGLang's tree verification
    (``verify_tree_greedy_func``, ``tree_speculative_sampling_target_only``).

    Args:
        tree: A ``DDTree`` or ``DDTreeBatch``.

    Returns:
        (retrieve_index, retrieve_next_token, retrieve_next_sibling), each of shape [n + 1]
        (or [bs, budget + 1]), int64. ``retrieve_index`` is the flattened node index
        ``b * (budget + 1) + i``; the links are node indices or -1. Children are linked in
        index order; padding nodes are never linked.
    """
    parents = _as_batch(tree.parents, tree)
    bs, width = parents.shape
    device = parents.device
    nodes = torch.arange(width, device=device).expand(bs, width)
    is_node = (nodes >= 1) & (nodes <= _num_nodes_tensor(tree)[:, None])
    # Non-nodes (root, padding) go to an extra parent column that is dropped.
    parent_col = torch.where(is_node, parents, width)

    first_child = torch.full((bs, width + 1), width, dtype=torch.int64, device=device)
    first_child.scatter_reduce_(
        1, parent_col, torch.where(is_node, nodes, width), reduce="amin", include_self=True
    )
    first_child = first_child[:, :width]
    next_token = torch.where(first_child < width, first_child, -1)

    # Sort nodes by (parent, index): consecutive entries with the same parent are siblings.
    order = (parent_col * width + nodes).sort(dim=1).indices
    sorted_parent = parent_col.gather(1, order)
    following = torch.roll(order, -1, dims=1)
    same_parent = (sorted_parent == torch.roll(sorted_parent, -1, dims=1)) & (
        sorted_parent < width
    )
    same_parent[:, -1] = False
    next_sibling = torch.full((bs, width), -1, dtype=torch.int64, device=device)
    next_sibling.scatter_(1, order, torch.where(same_parent, following, -1))

    retrieve_index = torch.arange(bs * width, device=device).view(bs, width)
    return (
        _as_tree_shape(retrieve_index, tree),
        _as_tree_shape(next_token, tree),
        _as_tree_shape(next_sibling, tree),
    )


# --------------------------------------------------------------------------- verify walk
def follow_verified_tree(tree: DDTree, target_tokens: torch.Tensor) -> Tuple[torch.Tensor, int]:
    """Walk the target's picks down the tree (host side).

    Args:
        tree: One request's tree.
        target_tokens: The target's token at every node, root first. Shape: [n + 1].

    Returns:
        (accepted_indices, next_token): node indices from the root (index 0) down the
        accepted path, int64 [1 + accepted]; and the target's pick at the last accepted
        node (the next bonus token). Acceptance length = len(accepted_indices).
    """
    if target_tokens.shape != (tree.num_nodes + 1,):
        raise ValueError(
            f"target_tokens must have shape ({tree.num_nodes + 1},), "
            f"got {tuple(target_tokens.shape)}."
        )
    picks: List[int] = target_tokens.tolist()
    path = [0]
    while (path[-1], picks[path[-1]]) in tree.child_map:
        path.append(tree.child_map[(path[-1], picks[path[-1]])])
    return torch.tensor(path, dtype=torch.int64), picks[path[-1]]


def follow_verified_tree_batch(
    tree: DDTreeBatch, target_tokens: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Walk the target's picks down every tree of a batch, on device, without host sync.

    Args:
        tree: The batch's trees.
        target_tokens: The target's token at every node, root first. Shape: [bs, budget + 1].

    Returns:
        (accept_lengths, accepted_indices): accept_lengths [bs] = 1 + accepted nodes;
        accepted_indices [bs, max_depth + 1] = node indices from the root down the accepted
        path, padded by repeating the last accepted node (so every entry is a valid index
        and ``accepted_indices[b, accept_lengths[b] - 1]`` is the last accepted node; the
        next bonus token is the target's pick there).

    Notes:
        A node is accepted iff it and all its ancestors carry the target's pick at their
        parent; siblings hold distinct tokens, so the accepted nodes form one path.
    """
    bs, width = tree.parents.shape
    if target_tokens.shape != (bs, width):
        raise ValueError(
            f"target_tokens must have shape ({bs}, {width}), got {tuple(target_tokens.shape)}."
        )
    device = target_tokens.device
    nodes = torch.arange(width, device=device)
    is_node = (nodes[None, 1:] <= tree.num_nodes[:, None])
    picked = tree.tokens == target_tokens.gather(1, tree.parents[:, 1:].clamp(min=0))
    ok = F.pad(is_node & picked, (1, 0), value=True)
    on_path = ~(tree.visibility & ~ok[:, None, :]).any(dim=2)
    depths = F.pad(tree.depths, (1, 0))
    accept_lengths = on_path.sum(dim=1)
    last = torch.where(on_path, depths, -1).argmax(dim=1)
    # Scatter path nodes into their depth slot; the tail repeats the last accepted node.
    slots = tree.max_depth + 1
    accepted = last[:, None].expand(bs, slots + 1).clone()
    accepted.scatter_(
        1, torch.where(on_path, depths, slots), nodes.expand(bs, width).clone()
    )
    return accept_lengths, accepted[:, :slots]


# --------------------------------------------------------------------------- one decode round
def ddtree_verify_inputs(
    tree: DDTreeBatch,
    bonus_tokens: torch.Tensor,
    prefix_lens: torch.Tensor,
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The target verify's inputs for ``[root] + nodes`` of every tree of a batch.

    Args:
        tree: The batch's trees (``budget + 1`` columns with the root).
        bonus_tokens: The last committed token of each request (the root). Shape: [bs].
        prefix_lens: Committed tokens per request. Shape: [bs].
        req_pool_indices: Each request's row of ``req_to_token``. Shape: [bs].
        req_to_token: The KV slot of every (request row, position). Shape: [rows, context].

    Returns:
        (ids, positions, slots), each [bs, budget + 1]: token ids (padding nodes carry 0),
        positions ``prefix + depth`` (padding nodes sit at depth 1, where no real node can see
        them), and the KV slots reserved right after each prefix (int64), one per node.

    Notes:
        Static shapes and no host sync, so the worker captures it with the tree build. The
        slot columns are clamped to the table so a padded batch row (stale lengths inside a
        CUDA graph) never reads past it.
    """
    bs, width = tree.parents.shape
    offsets = torch.arange(width, device=prefix_lens.device)
    is_node = offsets[None, 1:] <= tree.num_nodes[:, None]
    ids = torch.cat(
        [bonus_tokens.view(bs, 1).to(tree.tokens.dtype), torch.where(is_node, tree.tokens, 0)],
        dim=1,
    )
    depths = torch.cat(
        [torch.zeros_like(tree.depths[:, :1]), torch.where(is_node, tree.depths, 1)], dim=1
    )
    prefix = prefix_lens.view(bs, 1).to(torch.int64)
    columns = (prefix + offsets[None, :]).clamp(max=req_to_token.shape[1] - 1)
    slots = req_to_token[req_pool_indices.view(bs, 1).to(torch.int64), columns]
    return ids, prefix + depths, slots.to(torch.int64)


@dataclass
class DDTreeCommit:
    """What a verified round commits, per request; every field is a device tensor."""

    # 1 + accepted nodes: the tokens this round adds. Shape: [bs], int32.
    commit_lens: torch.Tensor
    # The target's pick at the last accepted node (next round's root). Shape: [bs].
    bonus: torch.Tensor
    # Accepted node tokens then the bonus, zero padded to the draft block. Shape: [bs, S].
    out_tokens: torch.Tensor
    # prefix + commit_lens. Shape: [bs], prefix_lens' dtype.
    new_seq_lens: torch.Tensor
    # The verify slots reordered so the accepted path comes first. Shape: [bs, budget + 1].
    committed_slots: torch.Tensor
    # Node indices of the accepted path from the root, padded by repeating the last one.
    # Shape: [bs, S].
    path: torch.Tensor


def ddtree_commit_plan(
    tree: DDTreeBatch,
    target_tokens: torch.Tensor,
    ids: torch.Tensor,
    slots: torch.Tensor,
    prefix_lens: torch.Tensor,
) -> DDTreeCommit:
    """Walk the target's picks down the trees and plan the commit, on device, no host sync.

    Args:
        tree: The batch's trees, ``tree.max_depth + 1`` = S (the draft block size).
        target_tokens: The target's pick at every node, root first. Shape: [bs, budget + 1].
        ids, slots: From ``ddtree_verify_inputs``. Shape: [bs, budget + 1].
        prefix_lens: Committed tokens per request before the round. Shape: [bs].

    Notes:
        The accepted path's KV was computed at positions ``prefix + depth``, i.e. already in
        place, so committing is a permutation of the reserved slots: path slots first (in
        depth order), the others after them in node order, still reserved for the next round.
    """
    bs, width = ids.shape
    device = ids.device
    accept_len, path = follow_verified_tree_batch(tree, target_tokens)
    block = path.shape[1]
    block_offsets = torch.arange(block, device=device)
    accepted = accept_len - 1
    bonus = target_tokens.gather(1, path.gather(1, accepted[:, None])).view(-1)
    path_ids = ids.gather(1, path)
    out_tokens = torch.where(
        block_offsets[None, :] < accepted[:, None],
        torch.cat([path_ids[:, 1:], torch.zeros_like(path_ids[:, :1])], dim=1),
        torch.zeros_like(path_ids),
    )
    out_tokens.scatter_(1, accepted[:, None], bonus[:, None])
    commit_lens = accept_len.to(torch.int32)
    # Sort key: depth for path nodes, width + index for the others; the extra column
    # `width` absorbs the path's padding entries.
    rank = torch.cat(
        [
            (width + torch.arange(width, device=device)).expand(bs, width),
            torch.zeros((bs, 1), dtype=torch.int64, device=device),
        ],
        dim=1,
    )
    on_path = block_offsets[None, :] <= accepted[:, None]
    rank.scatter_(1, torch.where(on_path, path, width), block_offsets.expand(bs, block).contiguous())
    return DDTreeCommit(
        commit_lens=commit_lens,
        bonus=bonus,
        out_tokens=out_tokens,
        new_seq_lens=prefix_lens + commit_lens.to(prefix_lens.dtype),
        committed_slots=slots.gather(1, torch.argsort(rank[:, :width], dim=1)),
        path=path,
    )


def draft_top1_agreement(
    draft_top1: torch.Tensor, target_tokens: torch.Tensor, path: torch.Tensor, accept_lengths: torch.Tensor
) -> torch.Tensor:
    """Per depth: did the draft's top-1 token equal the target's token there (debug metric)?

    The target's token at depth ``d`` is its pick at the accepted path's node of depth
    ``d - 1``, known for ``d <= accept_length`` (the last one is the bonus token); deeper
    depths are unknown this round.

    Args:
        draft_top1: The draft's most likely token per depth (row ``d - 1`` is depth d). Shape: [bs, L].
        target_tokens: The target's pick at every node, root first. Shape: [bs, budget + 1].
        path, accept_lengths: From ``follow_verified_tree_batch``. Shapes: [bs, L + 1], [bs].

    Returns:
        int64 [bs, L]: 1 agree, 0 disagree, -1 unknown.
    """
    depth_count = draft_top1.shape[1]
    target_at_depth = target_tokens.gather(1, path[:, :depth_count])
    agree = (draft_top1 == target_at_depth).to(torch.int64)
    known = torch.arange(depth_count, device=path.device)[None, :] < accept_lengths[:, None]
    return torch.where(known, agree, -1)


# --------------------------------------------------------------------------- metrics, checks
def summarize_ddtree(
    tree: DDTree, accepted_indices: Optional[torch.Tensor] = None
) -> Dict[str, Any]:
    """Shape and acceptance metrics of one tree (host side, for debug logging).

    Returns:
        budget, nodes, max_depth, leaves, branching (mean children of internal nodes, root
        included), max_branching, nodes_per_depth, and with ``accepted_indices``:
        accepted_nodes, accepted_depth and accept_length.
    """
    parents: List[int] = tree.parents.tolist()
    depths: List[int] = tree.depths.tolist()
    children = [0] * len(parents)
    for parent in parents[1:]:
        children[parent] += 1
    internal = [c for c in children if c > 0]
    max_depth = max(depths, default=0)
    summary: Dict[str, Any] = {
        "budget": tree.budget,
        "nodes": tree.num_nodes,
        "max_depth": max_depth,
        "leaves": sum(1 for c in children[1:] if c == 0),
        "branching": sum(internal) / len(internal) if internal else 0.0,
        "max_branching": max(children),
        "nodes_per_depth": [depths.count(d) for d in range(1, max_depth + 1)],
    }
    if accepted_indices is not None:
        path: List[int] = accepted_indices.tolist()
        summary["accepted_nodes"] = len(path) - 1
        summary["accepted_depth"] = depths[path[-1] - 1] if len(path) > 1 else 0
        summary["accept_length"] = len(path)
    return summary


def assert_prefix_closed(tree: DDTree) -> None:
    """Check the invariants of a draft tree; raise AssertionError naming the first broken one.

    Parents precede children, depths grow by one along edges, every node's parent is in the
    tree, scores are finite and never rise along an edge, sibling tokens are distinct, and
    ``visibility`` is exactly the ancestor-or-self relation.
    """
    parents: List[int] = tree.parents.tolist()
    depths: List[int] = [0] + tree.depths.tolist()
    scores: List[float] = [0.0] + tree.scores.tolist()
    tokens: List[int] = tree.tokens.tolist()
    n = tree.num_nodes
    if len(parents) != n + 1 or len(depths) != n + 1 or len(scores) != n + 1:
        raise AssertionError(f"array lengths disagree: parents {len(parents)}, nodes {n}")
    if parents[0] != -1:
        raise AssertionError(f"parents[0] must be -1, got {parents[0]}")
    seen = set()
    for i in range(1, n + 1):
        p = parents[i]
        if not 0 <= p < i:
            raise AssertionError(f"node {i}: parent {p} is not an earlier node")
        if depths[i] != depths[p] + 1:
            raise AssertionError(f"node {i}: depth {depths[i]} under a depth-{depths[p]} parent")
        if not math.isfinite(scores[i]) or scores[i] > scores[p]:
            raise AssertionError(f"node {i}: score {scores[i]} under parent score {scores[p]}")
        if (p, tokens[i - 1]) in seen:
            raise AssertionError(f"node {i}: token {tokens[i - 1]} repeats under parent {p}")
        seen.add((p, tokens[i - 1]))
    expected = _ddtree_visibility(tree.parents.cpu()[None], max(depths))[0]
    if not torch.equal(tree.visibility.cpu(), expected):
        raise AssertionError("visibility is not the ancestor-or-self relation of parents")
