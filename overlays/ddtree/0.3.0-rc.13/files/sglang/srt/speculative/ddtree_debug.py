"""What ``--speculative-ddtree-debug`` logs for each request and round.

The worker writes one ``ddtree_debug`` JSON line per record (``tools/gpu``'s summaries read them);
the records are built here from the round's tensors, with one host sync (debug only).
"""

from __future__ import annotations

from typing import Dict, List

import torch

from sglang.srt.speculative.ddtree_utils import DDTreeBatch, DDTreeCommit, draft_top1_agreement


def ddtree_debug_records(
    tree: DDTreeBatch, picks: torch.Tensor, plan: DDTreeCommit, draft_top1: torch.Tensor
) -> List[Dict[str, object]]:
    """Per request: the tree's size and depth, the accepted nodes, and the draft's top-1
    agreement per depth (1, 0, or -1 where the target's token there is unknown this round).
    A request's lines give its rounds and the histogram of its acceptance lengths.

    Args:
        tree: The round's trees. picks: the target's pick at every node, ``[bs, budget + 1]``.
        plan: The round's commit. draft_top1: the draft's top token per depth, ``[bs, S - 1]``.
    """
    nodes = tree.num_nodes.tolist()
    index = torch.arange(1, tree.budget + 1, device=tree.depths.device)
    is_node = index[None, :] <= tree.num_nodes[:, None]
    max_depth = torch.where(is_node, tree.depths, 0).max(dim=1).values.tolist()
    accept = plan.commit_lens.tolist()
    agreement = draft_top1_agreement(draft_top1, picks, plan.path, plan.commit_lens.to(torch.int64)).tolist()
    return [
        {
            "budget": tree.budget,
            "tree_nodes": nodes[i],
            "tree_depth": max_depth[i],
            "accepted_nodes": accept[i] - 1,
            "accept_length": accept[i],
            "draft_top1_agree": agreement[i],
        }
        for i in range(len(nodes))
    ]
