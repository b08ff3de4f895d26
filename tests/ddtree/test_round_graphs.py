"""Overlay ddtree 0.3.0-rc.7's round: the glue moved into the round's two CUDA graphs, on the CPU.

- ``ddtree_state_commit_nodes`` (the hybrid commit's nodes, now computed in the commit graph) equals
  SGLang 0.5.17's own ``_verify_commit_step_indices``, lifted from the release's spec_utils.py, fed
  the ``accept_index`` rc.6 built from the same path, for every track interval and length.
- ``ddtree_commit_round``'s new outputs (draft KV positions and slots, the path's hidden rows) are
  what rc.6's worker computed from the plan after the commit.
- ``DDTreeRoundGraphs``' bookkeeping around a replay (padded batches, the row views made once,
  the one copy that takes what leaves the round out of graph memory, the lm_head inside or
  outside the graph): CUDA graphs need a GPU, so a stand-in graph (this test only) replays the
  captured program eagerly into the same static tensors. Its results must equal the eager round's,
  and must survive the next replay.
- The vocabulary-shard rule (moved from the worker to ``ddtree_tp.py``).

``ddtree_round.py`` imports three sibling modules by their sglang names; the test registers the
version's own torch-only modules (and its Triton kernel file) under those names while it loads it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

from ddtree_deploy.catalog import load_overlay
from tests.ddtree.conftest import OVERLAYS, lift_release, load_tool
from tests.ddtree.test_commit_moves import walk_picks

RC7 = "ddtree@0.3.0-rc.7"
SPECULATIVE = "sglang/srt/speculative"
SIBLINGS = {  # the modules ddtree_round.py imports, by their sglang names (those a version ships)
    "sglang.srt.speculative.ddtree_utils": f"{SPECULATIVE}/ddtree_utils.py",
    "sglang.srt.speculative.ddtree_hybrid": f"{SPECULATIVE}/ddtree_hybrid.py",
    "sglang.srt.speculative.ddtree_draft_kv": f"{SPECULATIVE}/ddtree_draft_kv.py",  # rc.17 on
    "sglang.kernels.ops.speculative.ddtree": "sglang/kernels/ops/speculative/ddtree.py",
}
BLOCK, VOCAB, HIDDEN, CONTEXT, BUDGET = 8, 40, 12, 300, 16


def _module(name: str, overlay: Any, path: str, tmp: Path) -> ModuleType:
    module = ModuleType(name)
    file = tmp / Path(path).name  # Triton reads a kernel's source from its file
    file.write_bytes(overlay.content_of(path, None))
    module.__file__ = str(file)
    sys.modules[name] = module
    exec(compile(file.read_text(), str(file), "exec"), module.__dict__)
    return module


@contextlib.contextmanager
def round_modules(spec: str, tmp: Path) -> Iterator[SimpleNamespace]:
    """A version's ``ddtree_round.py`` with its siblings registered under their sglang names while
    the caller uses it; ``sys.modules`` is restored afterwards."""
    overlay = load_overlay(spec, OVERLAYS)
    tag = spec.rsplit(".", 1)[-1]
    with load_tool().modules_restored([*SIBLINGS, f"ddtree_round_{tag}", f"ddtree_tp_{tag}"]):
        siblings = {name: _module(name, overlay, path, tmp) for name, path in SIBLINGS.items()
                    if path in overlay.manifest.files}
        rounds = _module(f"ddtree_round_{tag}", overlay, f"{SPECULATIVE}/ddtree_round.py", tmp)
        tp = _module(f"ddtree_tp_{tag}", overlay, f"{SPECULATIVE}/ddtree_tp.py", tmp)
        yield SimpleNamespace(
            utils=siblings["sglang.srt.speculative.ddtree_utils"],
            hybrid=siblings["sglang.srt.speculative.ddtree_hybrid"], round=rounds, tp=tp,
            draft_kv=siblings.get("sglang.srt.speculative.ddtree_draft_kv"),
        )


@pytest.fixture(scope="module")
def rc7(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    with round_modules(RC7, tmp_path_factory.mktemp("rc7")) as modules:
        yield modules


# --------------------------------------------------------------------------- SGLang's commit indices
@pytest.fixture(scope="module")
def sglang_step_indices() -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
    """0.5.17's ``_verify_commit_step_indices``, lifted from spec_utils.py; ``get_exec`` is a stand-in
    that holds the track interval the call asks for."""
    interval = SimpleNamespace(mamba_track_interval=0)
    namespace = lift_release(f"{SPECULATIVE}/spec_utils.py", ["_verify_commit_step_indices"], {
        "torch": torch, "Tuple": tuple, "Optional": Any, "ScheduleBatch": Any,
        "get_exec": lambda: SimpleNamespace(mamba=interval)})

    def call(*, path: torch.Tensor, commit_lens: torch.Tensor, prefix: torch.Tensor, track_interval: int | None,
             width: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        interval.mamba_track_interval = track_interval or 1
        rows = torch.arange(path.shape[0])
        batch = SimpleNamespace(seq_lens=prefix, mamba_track_indices=None if track_interval is None else rows)
        accept_index = path + rows[:, None] * width  # rc.6's worker: flat node indices, as EAGLE's
        return namespace["_verify_commit_step_indices"](
            batch=batch, accept_index=accept_index, accept_lens=commit_lens, draft_token_num=width)

    return call


def random_paths(g: torch.Generator, bs: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Increasing node paths from the root, padded by repeating the last, and their lengths."""
    commit_lens = torch.randint(1, BLOCK + 1, (bs,), generator=g, dtype=torch.int32)
    path = torch.zeros((bs, BLOCK), dtype=torch.int64)
    for b in range(bs):
        nodes = sorted(torch.randperm(width - 1, generator=g)[: int(commit_lens[b]) - 1].add(1).tolist())
        row = [0, *nodes]
        path[b] = torch.tensor(row + [row[-1]] * (BLOCK - len(row)))
    return path, commit_lens


@pytest.mark.parametrize("track_interval", [None, 1, 3, 8, 64, 256])
def test_commit_nodes_are_sglangs_commit_step_indices(rc7: SimpleNamespace, sglang_step_indices: Callable[..., Any],
                                                      track_interval: int | None) -> None:
    g = torch.Generator().manual_seed(track_interval or 0)
    crossed = 0
    for _ in range(20):
        path, commit_lens = random_paths(g, 6, BUDGET + 1)
        prefix = torch.randint(0, 600, (6,), generator=g)
        last, track = rc7.hybrid.ddtree_state_commit_nodes(path, commit_lens, prefix, track_interval)
        want_last, want_track = sglang_step_indices(path=path, commit_lens=commit_lens, prefix=prefix,
                                                    track_interval=track_interval, width=BUDGET + 1)
        assert last.dtype == torch.int64 and torch.equal(last, want_last)
        if track_interval is None:
            assert track is None and want_track is None
            continue
        assert track.dtype == torch.int64 and torch.equal(track, want_track)
        crossed += int((track >= 0).sum())
    if track_interval is not None:
        assert crossed > 0, "some round should cross a track boundary"


# --------------------------------------------------------------------------- one round, eager
def round_inputs(rc7: SimpleNamespace, bs: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden": torch.randn((bs, BLOCK - 1, HIDDEN), generator=g),
        "bonus": torch.randint(0, VOCAB, (bs,), generator=g),
        "prefix": torch.randint(0, CONTEXT - BUDGET - 2, (bs,), generator=g),
        "pool": torch.randperm(4, generator=g)[:bs],
        "req_to_token": torch.randperm(4 * CONTEXT, generator=g).view(4, CONTEXT).add(1),
    }


def head(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda hidden: torch.matmul(hidden.to(weight.dtype), weight.T) * 3.0


WEIGHT = torch.randn((VOCAB, HIDDEN), generator=torch.Generator().manual_seed(9))


def eager_round(rc7: SimpleNamespace, x: dict[str, torch.Tensor], seed: int, track_interval: int | None = 4) -> tuple[Any, Any, list]:
    moves: list = []
    r = rc7.round.ddtree_prepare_round(head(WEIGHT)(x["hidden"]), BUDGET, x["bonus"], x["prefix"], x["pool"],
                                       x["req_to_token"], with_links=True)
    picks = walk_picks(r.tree, torch.Generator().manual_seed(seed))
    c = rc7.round.ddtree_commit_round(r, picks, x["prefix"], lambda dst, src: moves.append((dst, src)),
                                      hybrid=True, track_interval=track_interval)
    return r, c, [picks, moves]


def test_commit_outputs_are_what_rc6_computed_after_the_commit(rc7: SimpleNamespace) -> None:
    x = round_inputs(rc7, 3, 1)
    r, c, (picks, _) = eager_round(rc7, x, 1)
    plan = c.plan
    n = BUDGET + 1
    hidden = torch.randn((3 * n, HIDDEN))
    rc6_rows = hidden.view(3, n, -1).gather(1, plan.path[:, :, None].expand(-1, -1, HIDDEN)).reshape(-1, HIDDEN)
    assert torch.equal(hidden.index_select(0, c.path_rows.reshape(-1)), rc6_rows)
    assert torch.equal(c.draft_slots, r.slots[:, :BLOCK])
    assert torch.equal(c.draft_positions, x["prefix"][:, None] + torch.arange(BLOCK)[None, :])
    last, track = rc7.hybrid.ddtree_state_commit_nodes(plan.path, plan.commit_lens, x["prefix"], 4)
    assert torch.equal(c.state_nodes, last) and torch.equal(c.track_nodes, track)
    assert int(plan.commit_lens.max()) >= 2, "the picks should accept something"


# --------------------------------------------------------------------------- the graphs' bookkeeping
def copy_into(static: Any, fresh: Any) -> None:
    """Write a fresh result into the static tensors of a captured one, as a replay does."""
    if isinstance(static, torch.Tensor):
        static.copy_(fresh)
    elif dataclasses.is_dataclass(static):
        for f in dataclasses.fields(static):
            copy_into(getattr(static, f.name), getattr(fresh, f.name))
    elif isinstance(static, tuple):
        for s, f in zip(static, fresh, strict=True):
            copy_into(s, f)


class EagerGraph:
    """A stand-in for torch.cuda.CUDAGraph (this test only): replay runs the program again on the
    static inputs and writes its result into the captured outputs."""

    def __init__(self, program: Callable[[], Any], outputs: Any) -> None:
        self.program, self.outputs = program, outputs

    def replay(self) -> None:
        copy_into(self.outputs, self.program())


def captured_graphs(rc7: SimpleNamespace, req_to_token: torch.Tensor, head_in_graph: bool,
                    moves: list, sizes: list[int], verify_mask: torch.Tensor | None = None) -> Any:
    graphs = rc7.round.DDTreeRoundGraphs(
        budget=BUDGET, depth=BLOCK - 1, hidden_size=HIDDEN, vocab_size=VOCAB, dtype=torch.float32,
        device=torch.device("cpu"), req_to_token=req_to_token, with_links=True,
        move_kv=lambda dst, src: moves.append((dst.clone(), src.clone())), draft_head=head(WEIGHT),
        head_in_graph=head_in_graph, verify_mask=verify_mask, track_interval=4)
    for size in sizes:  # DDTreeRoundGraphs.capture, with the stand-in graph
        x = graphs._inputs(size)
        round_tensors = graphs._prepare(x)
        round_commit, leaving = graphs._commit(x, round_tensors)
        graphs._graphs[size] = rc7.round._Captured(
            EagerGraph(lambda x=x: graphs._prepare(x), round_tensors),
            EagerGraph(lambda x=x, r=round_tensors: graphs._commit(x, r), (round_commit, leaving)),
            x, round_tensors, round_commit, leaving)
    return graphs


@pytest.mark.parametrize("head_in_graph", [True, False])
@pytest.mark.parametrize("bs", [1, 3])
def test_a_padded_replay_gives_the_eager_round(rc7: SimpleNamespace, head_in_graph: bool, bs: int) -> None:
    x = round_inputs(rc7, bs, bs)
    want_r, want_c, (picks, want_moves) = eager_round(rc7, x, bs)
    moves: list = []
    graphs = captured_graphs(rc7, x["req_to_token"], head_in_graph, moves, [4])
    r = graphs.prepare(x["hidden"], x["bonus"], x["prefix"], x["pool"])
    for name in ("ids", "positions", "slots", "next_token", "next_sibling"):
        assert torch.equal(getattr(r, name), getattr(want_r, name)), name
    assert torch.equal(r.tree.tokens, want_r.tree.tokens) and r.tree.tokens.shape[0] == bs
    c = graphs.commit(r, picks, x["prefix"])
    plan, want = c.plan, want_c.plan
    for name in ("commit_lens", "bonus", "out_tokens", "new_seq_lens", "path"):
        got, expected = getattr(plan, name), getattr(want, name)
        assert got.dtype == expected.dtype and torch.equal(got, expected), name
    for name in ("draft_positions", "draft_slots", "path_rows", "state_nodes", "track_nodes"):
        assert torch.equal(getattr(c, name), getattr(want_c, name)), name
    # The KV moves of the padded rows move nothing; the live rows move what the eager round moved.
    (dst, src), (want_dst, want_src) = moves[-1], want_moves[0]
    live = bs * (BLOCK - 1)
    assert torch.equal(dst[:live], want_dst) and torch.equal(src[:live], want_src)
    assert not dst[live:].any() and not src[live:].any()
    # What left the round survives the next round's replay; the row views are made once.
    kept = [t.clone() for t in (plan.commit_lens, plan.bonus, plan.out_tokens, plan.new_seq_lens)]
    other = round_inputs(rc7, bs, bs + 10)
    r2 = graphs.prepare(other["hidden"], other["bonus"], other["prefix"], other["pool"])
    graphs.commit(r2, walk_picks(r2.tree, torch.Generator().manual_seed(5)), other["prefix"])
    for before, now in zip(kept, (plan.commit_lens, plan.bonus, plan.out_tokens, plan.new_seq_lens), strict=True):
        assert torch.equal(before, now)
    assert r2 is r, "the row views are made once per size, not every round"


def test_a_batch_past_the_captured_sizes_runs_eagerly(rc7: SimpleNamespace) -> None:
    x = round_inputs(rc7, 3, 7)
    want_r, want_c, (picks, _) = eager_round(rc7, x, 7)
    graphs = captured_graphs(rc7, x["req_to_token"], True, [], [1, 2])
    r = graphs.prepare(x["hidden"], x["bonus"], x["prefix"], x["pool"])
    assert torch.equal(r.ids, want_r.ids) and r.verify_mask is None
    c = graphs.commit(r, picks, x["prefix"])
    assert torch.equal(c.plan.out_tokens, want_c.plan.out_tokens) and torch.equal(c.state_nodes, want_c.state_nodes)


# --------------------------------------------------------------------------- the TP vocabulary rule
def test_the_vocabulary_shard_rule(rc7: SimpleNamespace) -> None:
    shards = lambda added: SimpleNamespace(shard_indices=SimpleNamespace(num_added_elements=added))  # noqa: E731
    assert rc7.tp.ddtree_vocab_shards_refusal(tp_size=1, lm_head=object()) is None
    assert rc7.tp.ddtree_vocab_shards_refusal(tp_size=2, lm_head=shards(0)) is None
    lora = rc7.tp.ddtree_vocab_shards_refusal(tp_size=2, lm_head=shards(3))
    assert lora is not None and "3 added (LoRA) tokens per shard" in lora and "Pass --tp-size 1" in lora
    plain = rc7.tp.ddtree_vocab_shards_refusal(tp_size=4, lm_head=torch.nn.Linear(2, 2))
    assert plain is not None and "--tp-size 4" in plain and "got Linear" in plain


def torch_mask_fill(utils: ModuleType) -> Callable[..., None]:
    """A torch stand-in (this test only) for the Triton mask kernel, same layout, clipped at the
    buffer's end as the kernel is (test_verify_mask_kernel.py runs the kernel itself)."""

    def fill(*, mask_out: torch.Tensor, visibility: torch.Tensor, prefix_lens: torch.Tensor) -> None:
        n = visibility.shape[1]
        rows = []
        for b, prefix in enumerate(prefix_lens.tolist()):
            prefix_part = torch.ones((n, prefix), dtype=torch.bool)
            rows.append(torch.cat([prefix_part, visibility[b]], dim=1).reshape(-1))
        cells = torch.cat(rows)[: mask_out.numel()]
        mask_out[: cells.numel()] = cells

    return fill


def test_the_prepare_graph_writes_the_backends_mask_buffer(rc7: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    """The buffer is handed back whole (not cut to the batch's rows), and its first cells are the
    live rows' mask, as the eager fill writes it; the padded rows' cells come after them."""
    fill = torch_mask_fill(rc7.utils)
    monkeypatch.setattr(rc7.round, "fill_ddtree_verify_mask", fill)
    x = round_inputs(rc7, 2, 11)
    buffer = torch.zeros(4 * (BUDGET + 1) * (CONTEXT + BUDGET + 1), dtype=torch.bool)
    graphs = captured_graphs(rc7, x["req_to_token"], True, [], [4], verify_mask=buffer)
    r = graphs.prepare(x["hidden"], x["bonus"], x["prefix"], x["pool"])
    assert r.verify_mask is buffer
    n = BUDGET + 1
    cells = int((n * (x["prefix"] + n)).sum())
    want = torch.zeros(cells, dtype=torch.bool)
    fill(mask_out=want, visibility=r.tree.visibility, prefix_lens=x["prefix"])
    assert torch.equal(buffer[:cells], want)
    assert r.tree.visibility.shape[0] == 2 and want[: int(x["prefix"][0])].all() and not want.all()
