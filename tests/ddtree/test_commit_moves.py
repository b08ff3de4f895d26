"""Overlay ddtree 0.3.0-rc.4's commit: the accepted path's KV moves next to the prefix
(``ddtree_kv_moves``) and the round never writes ``req_to_token``.

First on random trees of every logit family: the moves, applied to a fake KV buffer as one gather
and scatter or in order in chunks (SGLang's ``move_kv_cache`` copies up to 128 or 256 slots per
launch), leave the accepted path's entries at the columns right after the prefix and touch nothing
but the request's own verify slots. Then a serving loop modelled on SGLang 0.5.17's overlap
scheduler, with its worst interleaving: a request that finished in round k - 1 still rides round k,
whose commit lands only after the scheduler has freed that request's row and slots, handed the row
to a new request and reserved the next round's slots (the WAR barrier waits for the verify's
read-done event only). Every committed position must keep its own KV, every slot must be freed
exactly once and the drain must give every slot back; rc.3's commit (a ``req_to_token`` rewrite)
fails the same loop.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType

import pytest
import torch

RC4 = "ddtree@0.3.0-rc.4"
RC3 = "ddtree@0.3.0-rc.3"
UTILS = "sglang/srt/speculative/ddtree_utils.py"
FAMILIES = ["sharp", "flat", "bf16", "integer", "masked"]


@pytest.fixture(scope="module")
def rc4(decode_tool: ModuleType) -> ModuleType:
    return decode_tool.load_overlay_module(RC4, UTILS)


@pytest.fixture(scope="module")
def rc3(decode_tool: ModuleType) -> ModuleType:
    return decode_tool.load_overlay_module(RC3, UTILS)


def code(uid: int, position: int, token: int) -> int:
    """The fake KV of `token` at `position` of request `uid`: what attention would read there."""
    return (uid * 1000 + position) * 1000 + token


def walk_picks(tree, g: torch.Generator, stop: float = 0.15) -> torch.Tensor:
    """Target picks that follow a random path down each tree and stop at a random depth."""
    bs, width = tree.parents.shape
    picks = torch.zeros((bs, width), dtype=torch.int64)
    for b in range(bs):
        children: dict[int, list[tuple[int, int]]] = {}
        for (parent, token), child in tree.tree(b).child_map.items():
            children.setdefault(parent, []).append((child, token))
        node = 0
        while node in children and float(torch.rand((), generator=g)) > stop:
            kids = sorted(children[node])
            child, token = kids[int(torch.randint(len(kids), (), generator=g))]
            picks[b, node] = token
            node = child
        taken = {token for _, token in children.get(node, [])}
        picks[b, node] = next(t for t in range(10**6) if t not in taken)
    return picks


def gather_scatter(kv: torch.Tensor, dst: torch.Tensor, src: torch.Tensor) -> None:
    kv[dst] = kv[src]


def in_order(chunk: int) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]:
    """Move `chunk` entries at a time, one after another, as SGLang's chunked copy does."""

    def move(kv: torch.Tensor, dst: torch.Tensor, src: torch.Tensor) -> None:
        for start in range(0, dst.numel(), chunk):
            kv[dst[start : start + chunk]] = kv[src[start : start + chunk]]

    return move


# --------------------------------------------------------------------------- one round
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("budget", [7, 16, 48])  # >= S - 1, as the server requires
def test_moves_put_the_accepted_path_right_after_the_prefix(
    rc4: ModuleType, make_logits, family: str, budget: int
) -> None:
    bs, depth, vocab, width = 4, 7, 10, budget + 1
    g = torch.Generator().manual_seed(budget)
    tree = rc4.build_ddtree_batch(make_logits(family, (bs, depth, vocab), budget), budget)
    prefix = torch.tensor([0, 3, 40, 11])
    rows = torch.tensor([3, 1, 4, 2])
    req_to_token = torch.zeros((5, 128), dtype=torch.int64)
    req_to_token[1:] = torch.randperm(4 * 128, generator=g).view(4, 128) + 1  # slot 0 is padding
    picks = walk_picks(tree, g)
    ids, positions, slots = rc4.ddtree_verify_inputs(tree, torch.tensor([7, 8, 9, 6]), prefix, rows, req_to_token)
    plan = rc4.ddtree_commit_plan(tree, picks, ids, prefix)
    dst, src = rc4.ddtree_kv_moves(path=plan.path, commit_lens=plan.commit_lens, slots=slots)
    assert dst.shape == src.shape == (bs * depth,) and dst.dtype == src.dtype == torch.int64

    verified = torch.full((4 * 128 + 1,), -1, dtype=torch.int64)
    for b in range(bs):  # the verify writes node i's KV at its slot, at position prefix + depth
        for i in range(width):
            verified[slots[b, i]] = code(b, int(positions[b, i]), int(ids[b, i]))
    for move in (gather_scatter, in_order(1), in_order(3), in_order(bs * depth)):
        kv = verified.clone()
        move(kv, dst, src)
        changed = set((kv != verified).nonzero().view(-1).tolist())
        for b in range(bs):
            n = int(plan.commit_lens[b])
            path = plan.path[b, :n].tolist()
            start = int(prefix[b])
            columns = req_to_token[int(rows[b]), start : start + n]
            assert kv[columns].tolist() == [code(b, start + d, int(ids[b, path[d]])) for d in range(n)]
        assert changed <= set(slots[:, 1:].reshape(-1).tolist())  # only the verify's own slots
        assert int(kv[0]) == int(verified[0])
    real = dst != 0
    assert dst[real].unique().numel() == int(real.sum())  # no slot written twice
    assert bool(((dst == 0) == (src == 0)).all())
    per_request = real.view(bs, depth).sum(dim=1)
    assert bool((per_request <= plan.commit_lens - 1).all())  # at most accepted (<= S - 1) moves
    assert bool(real.any()), "the walks should accept nodes that are not in place yet"


def test_stale_rows_of_a_padded_graph_move_nothing(rc4: ModuleType, make_logits) -> None:
    """Rows from `live_rows` on hold a padded CUDA graph's stale values; their slots may belong to
    another request by now, so all their entries are the padding slot's 0 -> 0."""
    tree = rc4.build_ddtree_batch(make_logits("sharp", (3, 5, 8), 3), 12)
    g = torch.Generator().manual_seed(3)
    picks = walk_picks(tree, g, stop=0.0)  # accept as deep as the trees go
    req_to_token = torch.arange(1, 4 * 64 + 1).view(4, 64)
    ids, _, slots = rc4.ddtree_verify_inputs(tree, torch.zeros(3, dtype=torch.int64), torch.tensor([2, 5, 9]),
                                             torch.tensor([1, 2, 3]), req_to_token)
    plan = rc4.ddtree_commit_plan(tree, picks, ids, torch.tensor([2, 5, 9]))
    moves = {}
    for live in (3, 1, 0):
        dst, src = rc4.ddtree_kv_moves(path=plan.path, commit_lens=plan.commit_lens, slots=slots,
                                       live_rows=torch.tensor([live]))
        moves[live] = (dst.view(3, -1), src.view(3, -1))
        assert not bool(dst.view(3, -1)[live:].any()) and not bool(src.view(3, -1)[live:].any())
    full_dst, full_src = moves[3]
    assert int((full_dst[1:] != 0).sum()) > 0, "the stale rows should have had moves to drop"
    assert torch.equal(moves[1][0][0], full_dst[0]) and torch.equal(moves[1][1][0], full_src[0])


# --------------------------------------------------------------------------- serving loop
@dataclass
class Request:
    uid: int
    prompt_len: int
    max_new: int
    row: int = -1
    prompt_slots: list[int] = field(default_factory=list)  # the prefill's out_cache_loc
    # The device's tokens and seq_lens: one round ahead of the host's view (the last token, the
    # bonus, has no KV yet).
    seq: list[int] = field(default_factory=list)
    gpu_prefix: int = 0
    committed: int = 0  # kv_committed_len: the host's view
    allocated: int = 0  # kv_allocated_len
    finished: bool = False


class Server:
    """ReqToTokenPool and the token allocator of SGLang 0.5.17 in miniature (page size 1), driven
    by its overlap loop with the interleaving above. `commit` is the worker's commit under test."""

    def __init__(self, dd: ModuleType, commit: str, *, rows: int, slots: int, budget: int, depth: int):
        self.dd, self.commit, self.budget, self.depth = dd, commit, budget, depth
        self.width = budget + 1
        self.free_rows = deque(range(1, rows + 1))  # FIFO, row 0 is padding (memory_pool.py)
        self.free_slots = deque(range(1, slots + 1))  # slot 0 is padding (allocator/token.py)
        self.total_slots = slots
        self.req_to_token = torch.zeros((rows + 1, 256 + 4 + self.width), dtype=torch.int64)
        self.kv = torch.full((slots + 1,), -1, dtype=torch.int64)
        self.freed_twice = 0
        self.g = torch.Generator().manual_seed(11)
        self.corrupt: list[str] = []
        self.rows_taken_from_riders = 0  # rows handed out while their last owner's round was in flight

    def alloc(self, n: int) -> list[int]:
        assert len(self.free_slots) >= n, "the loop is sized to never run out"
        return [self.free_slots.popleft() for _ in range(n)]

    def free(self, slots: list[int]) -> None:
        present = set(self.free_slots)
        self.freed_twice += sum(s in present for s in slots) + len(slots) - len(set(slots))
        self.free_slots.extend(slots)

    def admit(self, req: Request) -> None:
        """Prefill on the schedule stream: a row, its prompt slots and req_to_token."""
        req.row = self.free_rows.popleft()
        req.prompt_slots = self.alloc(req.prompt_len)
        self.req_to_token[req.row, : req.prompt_len] = torch.tensor(req.prompt_slots)
        req.seq = [int(t) for t in torch.randint(1, 9, (req.prompt_len + 1,), generator=self.g)]
        req.committed = req.allocated = req.gpu_prefix = req.prompt_len

    def prefill_kv(self, req: Request) -> None:
        """The prefill forward's KV writes at its out_cache_loc: on the forward stream, after
        the round in flight."""
        for p, slot in enumerate(req.prompt_slots):
            self.kv[slot] = code(req.uid, p, req.seq[p])

    def reserve(self, req: Request) -> None:
        """DFLASH's prepare_for_decode: reserve up to the host's committed + 2 * verify width
        (the device may be one round, up to S tokens, ahead)."""
        want = max(req.allocated, req.committed + 2 * self.width)
        if want > req.allocated:
            self.req_to_token[req.row, req.allocated : want] = torch.tensor(self.alloc(want - req.allocated))
            req.allocated = want

    def release(self, req: Request) -> None:
        """release_kv_cache without a radix cache: the row's [0, allocated) slots, then the row."""
        self.free(self.req_to_token[req.row, : req.allocated].tolist())
        self.free_rows.append(req.row)

    def launch(self, batch: list[Request]) -> dict:
        """The round up to the verify's read-done event: tree, slot gather, verify KV writes."""
        bs = len(batch)
        logits = torch.randn((bs, self.depth, 8), generator=self.g) * 3.0
        tree = self.dd.build_ddtree_batch(logits, self.budget)
        prefix = torch.tensor([r.gpu_prefix for r in batch])
        rows = torch.tensor([r.row for r in batch])
        bonus = torch.tensor([r.seq[r.gpu_prefix] for r in batch])
        for r in batch:
            assert r.gpu_prefix + self.width <= r.allocated, "the verify reads reserved columns only"
        ids, positions, slots = self.dd.ddtree_verify_inputs(tree, bonus, prefix, rows, self.req_to_token)
        for b, r in enumerate(batch):
            for i in range(self.width):
                self.kv[slots[b, i]] = code(r.uid, int(positions[b, i]), int(ids[b, i]))
        return {"batch": batch, "tree": tree, "ids": ids, "slots": slots, "prefix": prefix, "rows": rows,
                "picks": walk_picks(tree, self.g, stop=0.2)}

    def land_commit(self, rnd: dict) -> None:
        """The rest of the round, after the scheduler has moved on."""
        tree, ids, slots, prefix = rnd["tree"], rnd["ids"], rnd["slots"], rnd["prefix"]
        if self.commit == "rc.4":
            plan = self.dd.ddtree_commit_plan(tree, rnd["picks"], ids, prefix)
            before = self.req_to_token.clone()
            dst, src = self.dd.ddtree_kv_moves(path=plan.path, commit_lens=plan.commit_lens, slots=slots)
            self.kv[dst] = self.kv[src]
            assert torch.equal(self.req_to_token, before)
        else:  # rc.3's worker: req_to_token[rows, prefix + 0..W) = committed_slots
            plan = self.dd.ddtree_commit_plan(tree, rnd["picks"], ids, slots, prefix)
            columns = prefix[:, None] + torch.arange(self.width)[None, :]
            self.req_to_token[rnd["rows"][:, None], columns] = plan.committed_slots
        for b, r in enumerate(rnd["batch"]):  # the device state advances, riders' too
            n = int(plan.commit_lens[b])
            path = plan.path[b, :n].tolist()
            r.seq[r.gpu_prefix + 1 :] = [int(ids[b, i]) for i in path[1:]] + [int(plan.bonus[b])]
            r.gpu_prefix += n
        rnd["plan"] = plan

    def settle(self, rnd: dict) -> list[Request]:
        """The host's processing of the round's results; returns the requests it finished."""
        plan, done = rnd["plan"], []
        for b, r in enumerate(rnd["batch"]):
            if r.finished:  # a rider: its results are dropped (batch_result_processor.py)
                continue
            r.committed += int(plan.commit_lens[b])
            if r.committed - r.prompt_len >= r.max_new:
                r.finished = True
                done.append(r)
        return done

    def check_kv(self, req: Request) -> None:
        have = self.kv[self.req_to_token[req.row, : req.committed]].tolist()
        want = [code(req.uid, p, req.seq[p]) for p in range(req.committed)]
        if have != want:
            self.corrupt.append(f"request {req.uid}: {sum(h != w for h, w in zip(have, want, strict=True))} positions")


def serve(dd: ModuleType, commit: str) -> Server:
    """Twelve requests, short ones first and long prompts later, through 4 rows (as
    --max-running-requests 4: a freed row is the next one handed out)."""
    server = Server(dd, commit, rows=4, slots=6000, budget=12, depth=4)
    waiting = deque(Request(uid, prompt_len, max_new) for uid, (prompt_len, max_new) in enumerate(
        [(4, 3), (6, 9), (5, 1), (9, 20), (40, 6), (70, 12), (3, 2), (90, 30), (55, 4), (8, 15), (120, 9), (2, 5)]))
    running: list[Request] = []
    in_flight = None
    while waiting or running or in_flight:
        rnd = server.launch(running) if running else None  # round k: riders included
        if in_flight is not None:  # the host processes round k - 1 while round k runs
            for r in server.settle(in_flight):
                server.release(r)
            running = [r for r in running if not r.finished]
        prefilled = []
        while waiting and server.free_rows:
            prefilled.append(waiting.popleft())
            server.admit(prefilled[-1])
        riders = {r.row for r in rnd["batch"] if r.finished} if rnd is not None else set()
        server.rows_taken_from_riders += sum(r.row in riders for r in prefilled)
        for r in running:  # the next round's reservation, before round k's commit lands
            server.reserve(r)
        if rnd is not None:
            server.land_commit(rnd)
        for r in prefilled:
            server.prefill_kv(r)
            server.reserve(r)
        for r in running:
            if rnd is not None and r in rnd["batch"]:
                server.check_kv(r)
        running += prefilled
        in_flight = rnd
    return server


def test_overlap_serving_keeps_every_request_kv_and_frees_every_slot_once(rc4: ModuleType) -> None:
    server = serve(rc4, "rc.4")
    assert server.rows_taken_from_riders >= 3, "the loop must hand riders' rows to new requests"
    assert server.corrupt == []
    assert server.freed_twice == 0
    assert sorted(server.free_slots) == list(range(1, server.total_slots + 1))  # no leak
    assert sorted(server.free_rows) == [1, 2, 3, 4]


def test_the_same_loop_catches_rc3s_req_to_token_rewrite(rc3: ModuleType) -> None:
    """rc.3 rewrote the rider's row after the scheduler had handed it to a new request with a
    longer prompt: that request reads a dead request's KV at the rewritten columns, and its
    release frees those slots a second time while its own slots leak."""
    server = serve(rc3, "rc.3")
    assert server.corrupt, "a reused row should lose its prompt KV"
    assert server.freed_twice > 0
    assert len(set(server.free_slots)) < server.total_slots  # the leak the double frees hide
    assert len(server.free_slots) == server.total_slots  # and why the free-slot count alone misses it
