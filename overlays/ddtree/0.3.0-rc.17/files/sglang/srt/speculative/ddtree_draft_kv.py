"""The drafter's KV append as a DDTREE round's CUDA graph replays it.

DFlash's worker writes the drafter's KV of the committed tokens with
``_append_target_hidden_to_draft_kv_by_loc``: the target's hidden states through the drafter's
``fc`` and, on CUDA, one fused projection of every layer's K and V into a workspace, then a
prefix-valid write per layer. DDTREE captures that append once per batch size
(``ddtree_round.DDTreeRoundGraphs``), since run in Python every round its ops and checks cost
more host time than the kernels take. A graph must own the memory it writes, and DFlash's helper
grows its workspace for a long prefill (freeing the old one), so the graph's append runs SGLang's
own code with a copy of the helper that owns a workspace of its own.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Optional, Tuple

# The append, by DFlash's keywords: target_hidden [bs * S, C], cache_loc [bs * S], cache_loc_2d
# [bs, S], positions [bs * S], commit_lens [bs] int32; a row's first commit_lens slots are written.
DraftKV = Callable[..., None]


def ddtree_graphed_draft_kv(worker: Any) -> Tuple[Optional[DraftKV], int]:
    """DFlash's append for a graph to capture, and the width of the target hidden states it reads.

    ``worker`` is the DFlash worker (``DFlashWorkerV2``); nothing of it changes outside a call. A
    drafter without DFlash's ``fc`` gets none (the round then appends eagerly).
    """
    width = int(getattr(getattr(worker.draft_model, "fc", None), "in_features", 0))
    if not width:
        return None, 0
    helper = copy.copy(worker._fused_kv_helper) if worker._use_fused_kv_materialize else None
    if helper is not None:  # the same weights; SGLang's helper allocates a workspace on first use
        helper._workspace_capacity = 0
        helper._proj_workspace = helper._k_workspace = helper._v_workspace = None

    def append(**kwargs: Any) -> None:
        saved = worker._fused_kv_helper, worker._use_fused_kv_materialize
        worker._fused_kv_helper = helper
        try:
            worker._append_target_hidden_to_draft_kv_by_loc(**kwargs)
        finally:  # DFlash's own appends keep its helper and fused path, whatever this one did
            worker._fused_kv_helper, worker._use_fused_kv_materialize = saved

    return append, width
