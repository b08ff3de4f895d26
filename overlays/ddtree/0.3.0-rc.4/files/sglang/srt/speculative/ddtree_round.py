"""A DDTREE round's device programs around the target verify, and their CUDA graphs.

``prepare`` builds the trees and the verify inputs before the verify; ``commit`` walks the
target's picks, plans the commit and moves the accepted path's KV next to the prefix after
it. Both are pure tensor programs with no host synchronisation, so ``DDTreeRoundGraphs``
captures each as one graph per batch size; the worker (``ddtree_worker_v2.py``) runs them.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Tuple

import torch

from sglang.srt.speculative.ddtree_utils import (
    DDTreeBatch,
    DDTreeCommit,
    build_ddtree_batch,
    ddtree_commit_plan,
    ddtree_kv_moves,
    ddtree_verify_inputs,
    tree_links,
)


@dataclasses.dataclass
class DDTreeRoundTensors:
    """The tree of a round and its verify inputs (see ``ddtree_verify_inputs``)."""

    tree: DDTreeBatch
    ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    # First-child / next-sibling links, for a hybrid target's tree kernels (else None).
    # Shape: [bs, budget + 1].
    next_token: Optional[torch.Tensor] = None
    next_sibling: Optional[torch.Tensor] = None


def ddtree_prepare_round(
    draft_logits: torch.Tensor,
    budget: int,
    bonus_tokens: torch.Tensor,
    prefix_lens: torch.Tensor,
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    with_links: bool = False,
) -> DDTreeRoundTensors:
    """Build the trees and the verify inputs: the round's device work before the verify."""
    tree = build_ddtree_batch(draft_logits, budget)
    ids, positions, slots = ddtree_verify_inputs(
        tree, bonus_tokens, prefix_lens, req_pool_indices, req_to_token
    )
    round_tensors = DDTreeRoundTensors(tree=tree, ids=ids, positions=positions, slots=slots)
    if with_links:
        _, round_tensors.next_token, round_tensors.next_sibling = tree_links(tree)
    return round_tensors


KVMove = Callable[[torch.Tensor, torch.Tensor], None]  # the KV pool's move_kv_cache(dst, src)


def ddtree_commit_round(
    round_tensors: DDTreeRoundTensors,
    picks: torch.Tensor,
    prefix_lens: torch.Tensor,
    move_kv: KVMove,
    live_rows: Optional[torch.Tensor] = None,
) -> DDTreeCommit:
    """Walk the picks, plan the commit and move the accepted path's KV into place: the
    round's device work after the verify. It writes target KV only, never ``req_to_token``
    (see ``ddtree_kv_moves``)."""
    plan = ddtree_commit_plan(round_tensors.tree, picks, round_tensors.ids, prefix_lens)
    move_kv(*ddtree_kv_moves(path=plan.path, commit_lens=plan.commit_lens,
                             slots=round_tensors.slots, live_rows=live_rows))
    return plan


def _rows(value, bs: int):
    """The first ``bs`` rows of every tensor in a (nested dataclass of) tensors."""
    if isinstance(value, torch.Tensor):
        return value[:bs]
    return dataclasses.replace(
        value,
        **{
            f.name: _rows(getattr(value, f.name), bs)
            for f in dataclasses.fields(value)
            if isinstance(getattr(value, f.name), (torch.Tensor, DDTreeBatch))
        },
    )


class DDTreeRoundGraphs:
    """CUDA graphs of a round's two tensor programs, one pair per batch size, so their
    few hundred small kernels replay as two launches: ``prepare`` (tree build and verify
    inputs, before the target verify) and ``commit`` (the walk, the commit plan and the
    KV moves, after it). A batch is padded up to the next captured size; larger batches
    run eagerly. Rows past the batch hold stale values that nothing reads, and move no KV.

    Outputs live in the graphs' static memory and are overwritten by the next round, so
    the worker clones whatever leaves the round (tokens and lengths the scheduler reads).
    """

    def __init__(self, *, budget: int, depth: int, vocab_size: int, dtype: torch.dtype,
                 device: torch.device, req_to_token: torch.Tensor, with_links: bool,
                 move_kv: KVMove):
        self.budget = budget
        self.move_kv = move_kv
        self.with_links = with_links
        self.depth = depth
        self.vocab_size = vocab_size
        self.dtype = dtype
        self.device = device
        self.req_to_token = req_to_token
        self._graphs: Dict[int, Tuple[torch.cuda.CUDAGraph, torch.cuda.CUDAGraph, Dict[str, torch.Tensor], DDTreeRoundTensors, DDTreeCommit]] = {}

    def _inputs(self, bs: int) -> Dict[str, torch.Tensor]:
        def zeros(*shape, dtype=torch.int64):
            return torch.zeros(shape, dtype=dtype, device=self.device)

        return {
            "logits": zeros(bs, self.depth, self.vocab_size, dtype=self.dtype),
            "bonus": zeros(bs),
            "prefix_lens": zeros(bs),
            "req_pool_indices": zeros(bs),
            "picks": zeros(bs, self.budget + 1),
            "live_rows": zeros(1),  # 0 while capturing: the warm-up moves nothing
        }

    def _prepare(self, x: Dict[str, torch.Tensor]) -> DDTreeRoundTensors:
        return ddtree_prepare_round(x["logits"], self.budget, x["bonus"], x["prefix_lens"],
                                    x["req_pool_indices"], self.req_to_token, self.with_links)

    def _commit(self, x: Dict[str, torch.Tensor], r: DDTreeRoundTensors) -> DDTreeCommit:
        return ddtree_commit_round(r, x["picks"], x["prefix_lens"], self.move_kv, x["live_rows"])

    def capture(self, batch_sizes: List[int]) -> None:
        pool = torch.cuda.graph_pool_handle()
        for bs in sorted(set(batch_sizes), reverse=True):
            x = self._inputs(bs)
            stream = torch.cuda.Stream(device=self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm up allocator and kernels off the capture
                    self._commit(x, self._prepare(x))
            torch.cuda.current_stream(self.device).wait_stream(stream)
            prepare, commit = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            with torch.cuda.graph(prepare, pool=pool, capture_error_mode="thread_local"):
                round_tensors = self._prepare(x)
            with torch.cuda.graph(commit, pool=pool, capture_error_mode="thread_local"):
                plan = self._commit(x, round_tensors)
            self._graphs[bs] = (prepare, commit, x, round_tensors, plan)

    def _entry(self, bs: int):
        fits = [size for size in self._graphs if size >= bs]
        return self._graphs[min(fits)] if fits else None

    def prepare(self, draft_logits: torch.Tensor, bonus_tokens: torch.Tensor,
                prefix_lens: torch.Tensor, req_pool_indices: torch.Tensor) -> DDTreeRoundTensors:
        bs = int(draft_logits.shape[0])
        entry = self._entry(bs)
        if entry is None:
            return ddtree_prepare_round(draft_logits, self.budget, bonus_tokens, prefix_lens,
                                        req_pool_indices, self.req_to_token, self.with_links)
        graph, _, x, round_tensors, _ = entry
        x["logits"][:bs].copy_(draft_logits)
        x["bonus"][:bs].copy_(bonus_tokens.view(-1))
        x["prefix_lens"][:bs].copy_(prefix_lens.view(-1))
        x["req_pool_indices"][:bs].copy_(req_pool_indices.view(-1))
        graph.replay()
        return _rows(round_tensors, bs)

    def commit(self, round_tensors: DDTreeRoundTensors, picks: torch.Tensor,
               prefix_lens: torch.Tensor) -> DDTreeCommit:
        bs = int(picks.shape[0])
        entry = self._entry(bs)
        if entry is None:
            return ddtree_commit_round(round_tensors, picks, prefix_lens, self.move_kv)
        _, graph, x, _, plan = entry
        x["picks"][:bs].copy_(picks)
        x["live_rows"].fill_(bs)
        graph.replay()
        plan = _rows(plan, bs)
        # new_seq_lens in prefix_lens' dtype, like the eager plan.
        return dataclasses.replace(plan, new_seq_lens=plan.new_seq_lens.to(prefix_lens.dtype))
