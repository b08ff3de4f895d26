"""Overlay ddtree 0.3.0-rc.17's third round graph: the drafter's KV of the committed tokens, on the CPU.

rc.17 replays DFlash's draft-KV append from a CUDA graph after the commit graph, reading the accepted
path's target hidden states from one buffer shared by the batch sizes and the commit graph's slots,
positions and lengths. CUDA graphs need a GPU, so, as in ``test_round_graphs.py``, a stand-in graph
(this test only) replays the captured program eagerly into the same static memory, and a stand-in
append (this test only) records what SGLang's ``set_kv_buffer_prefix_valid`` would write: a row's
first ``commit_lens`` slots, each with its position and hidden row. The graph's writes must be the
eager append's (rc.16's worker) for exact and padded batches, including after a larger batch left
stale rows behind; a batch no graph takes must write nothing and be left to the eager append.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.ddtree.test_commit_moves import walk_picks
from tests.ddtree.test_round_graphs import (
    BLOCK,
    BUDGET,
    HIDDEN,
    VOCAB,
    WEIGHT,
    EagerGraph,
    eager_round,
    head,
    round_inputs,
    round_modules,
)

RC17 = "ddtree@0.3.0-rc.17"
WIDTH = 3 * HIDDEN  # the verify's captured layers, concatenated (DFlash's fc input)


@pytest.fixture(scope="module")
def rc17(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    with round_modules(RC17, tmp_path_factory.mktemp("rc17")) as modules:
        yield modules


class DraftKVStore:
    """A stand-in (this test only) for DFlash's draft-KV append at the worker's keywords: each row's
    first ``commit_lens`` slots take their position and hidden row, as the prefix-valid write does."""

    def __init__(self) -> None:
        self.slots: dict[int, tuple[int, torch.Tensor]] = {}

    def __call__(self, *, target_hidden: torch.Tensor, cache_loc: torch.Tensor, cache_loc_2d: torch.Tensor,
                 positions: torch.Tensor, commit_lens: torch.Tensor) -> None:
        bs, block = cache_loc_2d.shape
        assert target_hidden.shape == (bs * block, WIDTH) and positions.shape == cache_loc.shape == (bs * block,)
        assert commit_lens.dtype == torch.int32 and torch.equal(cache_loc, cache_loc_2d.reshape(-1))
        for b in range(bs):
            for j in range(int(commit_lens[b])):
                row = b * block + j
                self.slots[int(cache_loc_2d[b, j])] = (int(positions[row]), target_hidden[row].clone())

    def same_as(self, other: DraftKVStore) -> bool:
        return self.slots.keys() == other.slots.keys() and all(
            self.slots[k][0] == other.slots[k][0] and torch.equal(self.slots[k][1], other.slots[k][1])
            for k in self.slots)


def graphs_with_draft_kv(rc17: SimpleNamespace, req_to_token: torch.Tensor, store: DraftKVStore,
                         sizes: list[int]) -> Any:
    """``DDTreeRoundGraphs.capture`` with the stand-in graph: the shared path buffer at the largest
    size, then the three programs per size."""
    graphs = rc17.round.DDTreeRoundGraphs(
        budget=BUDGET, depth=BLOCK - 1, hidden_size=HIDDEN, vocab_size=VOCAB, dtype=torch.float32,
        device=torch.device("cpu"), req_to_token=req_to_token, with_links=True, move_kv=lambda dst, src: None,
        draft_head=head(WEIGHT), head_in_graph=True, verify_mask=None, track_interval=4,
        draft_kv=store, target_hidden_width=WIDTH)
    graphs._path_hidden = torch.zeros((max(sizes) * BLOCK, WIDTH))
    for size in sizes:
        x = graphs._inputs(size)
        round_tensors = graphs._prepare(x)
        round_commit, leaving = graphs._commit(x, round_tensors)
        graphs._graphs[size] = rc17.round._Captured(
            EagerGraph(lambda x=x: graphs._prepare(x), round_tensors),
            EagerGraph(lambda x=x, r=round_tensors: graphs._commit(x, r), (round_commit, leaving)),
            x, round_tensors, round_commit, leaving,
            EagerGraph(lambda x=x, c=round_commit: graphs._draft_kv(x, c), None))
    return graphs


def graph_round(graphs: Any, x: dict[str, torch.Tensor], seed: int, hidden: torch.Tensor) -> tuple[Any, bool]:
    r = graphs.prepare(x["hidden"], x["bonus"], x["prefix"], x["pool"])
    c = graphs.commit(r, walk_picks(r.tree, torch.Generator().manual_seed(seed)), x["prefix"])
    return c, graphs.append_draft_kv(hidden, c)


def eager_append(rc17: SimpleNamespace, x: dict[str, torch.Tensor], seed: int, hidden: torch.Tensor) -> DraftKVStore:
    """rc.16's worker: the path's hidden rows gathered, then the append, eagerly."""
    _, c, _ = eager_round(rc17, x, seed)
    store = DraftKVStore()
    store(target_hidden=hidden.index_select(0, c.path_rows.reshape(-1)), cache_loc=c.draft_slots.reshape(-1),
          cache_loc_2d=c.draft_slots, positions=c.draft_positions.reshape(-1), commit_lens=c.plan.commit_lens)
    return store


def verify_hidden(bs: int, seed: int) -> torch.Tensor:
    return torch.randn((bs * (BUDGET + 1), WIDTH), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("bs", [4, 3, 1])
def test_the_draft_kv_graph_writes_what_the_eager_append_writes(rc17: SimpleNamespace, bs: int) -> None:
    store = DraftKVStore()
    first = round_inputs(rc17, 4, 100)  # a full batch first, so a padded batch's rows are stale, not zero
    graphs = graphs_with_draft_kv(rc17, first["req_to_token"], store, [4])
    graph_round(graphs, first, 100, verify_hidden(4, 100))
    store.slots.clear()
    x = round_inputs(rc17, bs, bs)
    x["req_to_token"] = first["req_to_token"]
    hidden = verify_hidden(bs, bs)
    c, in_graph = graph_round(graphs, x, bs, hidden)
    want = eager_append(rc17, x, bs, hidden)
    assert in_graph and store.same_as(want)
    assert len(want.slots) == int(c.plan.commit_lens.sum()) >= bs, "every committed token is written once"


def test_a_batch_no_graph_takes_writes_nothing(rc17: SimpleNamespace) -> None:
    store = DraftKVStore()
    x = round_inputs(rc17, 3, 7)
    graphs = graphs_with_draft_kv(rc17, x["req_to_token"], store, [1, 2])
    _, in_graph = graph_round(graphs, x, 7, verify_hidden(3, 7))  # past the captured sizes
    assert not in_graph and not store.slots
    one = round_inputs(rc17, 1, 8)
    one["req_to_token"] = x["req_to_token"]
    for hidden in (verify_hidden(1, 8)[:, :HIDDEN], verify_hidden(1, 8).double()):  # another width, dtype
        _, in_graph = graph_round(graphs, one, 8, hidden)
        assert not in_graph and not store.slots
    _, in_graph = graph_round(graphs, one, 8, verify_hidden(1, 8))
    assert in_graph and store.same_as(eager_append(rc17, one, 8, verify_hidden(1, 8)))


def test_without_a_draft_kv_the_graphs_are_rc16s(rc17: SimpleNamespace) -> None:
    """A drafter without DFlash's fc gets no third graph: ``append_draft_kv`` leaves the append to the
    worker."""
    x = round_inputs(rc17, 2, 3)
    graphs = rc17.round.DDTreeRoundGraphs(
        budget=BUDGET, depth=BLOCK - 1, hidden_size=HIDDEN, vocab_size=VOCAB, dtype=torch.float32,
        device=torch.device("cpu"), req_to_token=x["req_to_token"], with_links=True, move_kv=lambda dst, src: None,
        draft_head=head(WEIGHT), head_in_graph=True, verify_mask=None, track_interval=4)
    assert graphs.draft_kv is None
    _, c, _ = eager_round(rc17, x, 3)
    assert not graphs.append_draft_kv(verify_hidden(2, 3), c)
