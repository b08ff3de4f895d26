"""Overlay ddtree 0.3.0-rc.17's third round graph: the drafter's KV of the committed tokens, on the CPU.

rc.17 replays DFlash's draft-KV append from a CUDA graph after the commit graph, reading the accepted
path's target hidden states from one buffer shared by the batch sizes and the commit graph's slots,
positions and lengths. CUDA graphs need a GPU, so ``DDTreeRoundGraphs.capture`` runs here as it is,
with its three CUDA-only seams replaced (this test only): no graph pool, no side stream, and a
stand-in graph that replays the captured program eagerly into the same static memory. A stand-in
append (this test only) records what SGLang's ``set_kv_buffer_prefix_valid`` would write: a row's
first ``commit_lens`` slots, each with its position and hidden row.

- The graph's writes are the eager append's (rc.16's worker) for exact and padded batches, after a
  larger batch left stale rows behind; a batch no graph takes writes nothing.
- A draft-KV capture that fails leaves the prepare and commit graphs in place and every size
  appending eagerly.
- ``ddtree_graphed_draft_kv`` (the worker's side, on a stand-in worker) hands the graph DFlash's
  append with a helper copy that owns its workspace, and leaves DFlash's helper and fused path as
  they were, even when the append fails or falls back.
"""

from __future__ import annotations

import contextlib
import logging
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


def captured(rc17: SimpleNamespace, req_to_token: torch.Tensor, sizes: list[int], draft_kv: Any) -> Any:
    """``DDTreeRoundGraphs.capture`` itself, with the CUDA-only seams stood in for."""
    graphs = rc17.round.DDTreeRoundGraphs(
        budget=BUDGET, depth=BLOCK - 1, hidden_size=HIDDEN, vocab_size=VOCAB, dtype=torch.float32,
        device=torch.device("cpu"), req_to_token=req_to_token, with_links=True, move_kv=lambda dst, src: None,
        draft_head=head(WEIGHT), head_in_graph=True, verify_mask=None, track_interval=4,
        draft_kv=draft_kv, target_hidden_width=WIDTH if draft_kv is not None else 0)

    def stand_in_graph(pool: Any, program: Any) -> tuple[EagerGraph, Any]:
        outputs = program()
        return EagerGraph(program, outputs), outputs

    graphs._new_pool = lambda: None
    graphs._side_stream = contextlib.nullcontext
    graphs._graph = stand_in_graph
    graphs.capture(sizes)
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


def inputs_on(rc17: SimpleNamespace, bs: int, seed: int, req_to_token: torch.Tensor) -> dict[str, torch.Tensor]:
    x = round_inputs(rc17, bs, seed)
    x["req_to_token"] = req_to_token
    return x


@pytest.mark.parametrize("bs", [4, 3, 1])
def test_the_draft_kv_graph_writes_what_the_eager_append_writes(rc17: SimpleNamespace, bs: int) -> None:
    store = DraftKVStore()
    first = round_inputs(rc17, 4, 100)  # a full batch first, so a padded batch's rows are stale, not zero
    graphs = captured(rc17, first["req_to_token"], [4, 2], store)
    assert not store.slots, "warm-up and capture write nothing: they have no live rows"
    assert graphs._path_hidden.shape == (4 * BLOCK, WIDTH), "one buffer, sized by the largest batch"
    assert all(entry.draft_kv is not None for entry in graphs._graphs.values())
    graph_round(graphs, first, 100, verify_hidden(4, 100))
    store.slots.clear()
    x = inputs_on(rc17, bs, bs, first["req_to_token"])
    hidden = verify_hidden(bs, bs)
    c, in_graph = graph_round(graphs, x, bs, hidden)
    want = eager_append(rc17, x, bs, hidden)
    assert in_graph and store.same_as(want)
    assert len(want.slots) == int(c.plan.commit_lens.sum()) >= bs, "every committed token is written once"


def test_a_batch_no_graph_takes_writes_nothing(rc17: SimpleNamespace, caplog: pytest.LogCaptureFixture) -> None:
    store = DraftKVStore()
    x = round_inputs(rc17, 3, 7)
    graphs = captured(rc17, x["req_to_token"], [1, 2], store)
    _, in_graph = graph_round(graphs, x, 7, verify_hidden(3, 7))  # past the captured sizes
    assert not in_graph and not store.slots
    one = inputs_on(rc17, 1, 8, x["req_to_token"])
    with caplog.at_level(logging.WARNING):
        for hidden in (verify_hidden(1, 8)[:, :HIDDEN], verify_hidden(1, 8).double()):  # another width, dtype
            _, in_graph = graph_round(graphs, one, 8, hidden)
            assert not in_graph and not store.slots
    assert sum("draft-KV graph's" in r.getMessage() for r in caplog.records) == 1, "warned once"
    _, eager_commit, _ = eager_round(rc17, one, 8)  # a commit that is not the size's replay
    assert not graphs.append_draft_kv(verify_hidden(1, 8), eager_commit) and not store.slots
    _, in_graph = graph_round(graphs, one, 8, verify_hidden(1, 8))
    assert in_graph and store.same_as(eager_append(rc17, one, 8, verify_hidden(1, 8)))


def test_a_failed_draft_kv_capture_keeps_the_other_graphs(rc17: SimpleNamespace,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    def failing(**kwargs: Any) -> None:
        raise RuntimeError("operation not permitted when stream is capturing")

    x = round_inputs(rc17, 2, 5)
    with caplog.at_level(logging.WARNING):
        graphs = captured(rc17, x["req_to_token"], [4, 2], failing)
    assert "draft-KV graph capture failed" in caplog.text
    assert graphs.draft_kv is None and graphs._path_hidden is None
    assert sorted(graphs._graphs) == [2, 4] and all(e.draft_kv is None for e in graphs._graphs.values())
    want_r, want_c, (picks, _) = eager_round(rc17, x, 5)
    r = graphs.prepare(x["hidden"], x["bonus"], x["prefix"], x["pool"])
    c = graphs.commit(r, picks, x["prefix"])
    assert torch.equal(c.plan.out_tokens, want_c.plan.out_tokens) and torch.equal(r.ids, want_r.ids)
    assert not graphs.append_draft_kv(verify_hidden(2, 5), c)


def test_without_a_draft_kv_the_round_appends_eagerly(rc17: SimpleNamespace) -> None:
    x = round_inputs(rc17, 2, 3)
    graphs = captured(rc17, x["req_to_token"], [2], None)
    assert graphs._graphs[2].draft_kv is None and graphs._path_hidden is None
    c, in_graph = graph_round(graphs, x, 3, verify_hidden(2, 3))
    assert not in_graph


# --------------------------------------------------------------------------- the worker's side
class FakeHelper:
    """A stand-in (this test only) for DFlash's FusedKVMaterializeHelper: weights and a workspace."""

    def __init__(self) -> None:
        self.flat_kv_weight_t = torch.ones(2, 2)
        self._workspace_capacity = 64
        self._proj_workspace = self._k_workspace = self._v_workspace = torch.zeros(64)


def dflash_worker(fused: bool, width: int, append: Any) -> SimpleNamespace:
    """A stand-in (this test only) for the DFlash worker's fields the graphed append reads."""
    worker = SimpleNamespace(
        draft_model=SimpleNamespace(fc=torch.nn.Linear(width, 4)) if width else SimpleNamespace(),
        _fused_kv_helper=FakeHelper() if fused else None, _use_fused_kv_materialize=fused)
    worker._append_target_hidden_to_draft_kv_by_loc = lambda **kwargs: append(worker, **kwargs)
    return worker


def test_the_graphed_append_runs_dflashs_with_a_helper_of_its_own(rc17: SimpleNamespace) -> None:
    seen: list[Any] = []
    worker = dflash_worker(True, WIDTH, lambda w, **kwargs: seen.append((w._fused_kv_helper, kwargs)))
    shared = worker._fused_kv_helper
    append, width = rc17.draft_kv.ddtree_graphed_draft_kv(worker)
    assert width == WIDTH and worker._fused_kv_helper is shared
    append(commit_lens="L")
    helper, kwargs = seen[0]
    assert kwargs == {"commit_lens": "L"}
    assert helper is not shared and helper.flat_kv_weight_t is shared.flat_kv_weight_t, "the same weights"
    assert helper._workspace_capacity == 0 and helper._proj_workspace is None, "a workspace of its own"
    assert shared._workspace_capacity == 64 and worker._fused_kv_helper is shared


def test_dflashs_helper_and_fused_path_survive_a_failing_append(rc17: SimpleNamespace) -> None:
    def falls_back_then_fails(w: SimpleNamespace, **kwargs: Any) -> None:
        w._use_fused_kv_materialize, w._fused_kv_helper = False, None  # DFlash's own fallback
        raise RuntimeError("capture invalidated")

    worker = dflash_worker(True, WIDTH, falls_back_then_fails)
    shared = worker._fused_kv_helper
    append, _ = rc17.draft_kv.ddtree_graphed_draft_kv(worker)
    with pytest.raises(RuntimeError):
        append()
    assert worker._fused_kv_helper is shared and worker._use_fused_kv_materialize is True


def test_no_fc_no_graphed_append_and_no_fused_path_no_helper(rc17: SimpleNamespace) -> None:
    assert rc17.draft_kv.ddtree_graphed_draft_kv(dflash_worker(True, 0, lambda w, **k: None)) == (None, 0)
    seen: list[Any] = []
    worker = dflash_worker(False, WIDTH, lambda w, **kwargs: seen.append(w._fused_kv_helper))
    append, _ = rc17.draft_kv.ddtree_graphed_draft_kv(worker)
    append()
    assert seen == [None] and worker._use_fused_kv_materialize is False
