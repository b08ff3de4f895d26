"""Overlay ddtree 0.3.0-rc.14's grammar-constrained rounds (``ddtree_grammar.py``), on the CPU, as the
newest version that changed them lands them (rc.16: keyword arguments, the redraw rule moved there).

rc.13 built each constrained request's masks the way SGLang's EAGLE tree verify does: SGLang's own
``generate_token_bitmask`` / ``traverse_tree`` (lifted here from the release's spec_utils.py) over
the tree's first-child / next-sibling links, every node its grammar admits masked before the picks.
rc.14 fills masks along the accepted path only and draws a refused pick again from the masked logits.
The tests hold rc.14 to rc.13's rule:

- greedy: the same accepted path and picks on it as the fully masked tree, on random trees with
  target picks that often follow the draft, with at most one fill per path node;
- sampled: the committed tokens follow the fully masked tree's distribution (chi-square), under
  temperature alone and under a truncating sampler (top-k), where every pick on the path is drawn
  again; a walk that ignores the grammar, and one that keeps allowed top-k draws, are told apart;
- a whole greedy decode (the decode tool's copy pair) under a grammar equals plain constrained
  greedy decoding, and differs from unconstrained decoding;
- rc.15 keeps such batches on the overlap scheduler, its worker running the grammar barrier first.

``ModGrammar`` is a stand-in (tests only) for SGLang's grammar objects: xgrammar's need its
tokenizer and SGLang's server stack to build. It keeps SGLang's packed bitmask layout (32 tokens to
an int32 word), which ``traverse_tree`` reads.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Callable
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

from ddtree_deploy.catalog import load_overlay
from tests.ddtree.conftest import OVERLAYS, lift_release

RC14 = "ddtree@0.3.0-rc.14"
GRAMMAR = "ddtree@0.3.0-rc.16"  # the newest version that changed the walk or the core it runs on
VOCAB, DEPTHS = 64, 7
BITS = torch.arange(32, dtype=torch.int64)


def pack(allowed: torch.Tensor) -> torch.Tensor:
    """bool [V] -> SGLang's int32 words, bit t % 32 of word t // 32 set where t is allowed."""
    words = math.ceil(allowed.numel() / 32)
    padded = torch.zeros(words * 32, dtype=torch.int64)
    padded[: allowed.numel()] = allowed.to(torch.int64)
    value = (padded.view(words, 32) << BITS).sum(1)
    return torch.where(value >= 2**31, value - 2**32, value).to(torch.int32)


def unpack(mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32 words [rows, words] -> bool [rows, vocab]."""
    return ((mask.to(torch.int64)[..., None] >> BITS) & 1).bool().view(mask.shape[0], -1)[:, :vocab]


class ModGrammar:
    """Stand-in grammar: token t is allowed where t % 3 differs from the state; accepting t makes
    t % 3 the state; ``end`` (if set) is always allowed and ends the grammar."""

    def __init__(self, state: int = 0, vocab: int = VOCAB, end: int | None = None) -> None:
        self.states: list[int] = [state]
        self.vocab, self.end, self.fills = vocab, end, 0

    def allowed(self) -> torch.Tensor:
        ok = torch.arange(self.vocab) % 3 != self.states[-1]
        if self.end is not None:
            ok[self.end] = True
        return ok

    def accept_token(self, token: int) -> None:
        assert self.allowed()[token], f"token {token} refused in state {self.states[-1]}"
        self.states.append(-1 if token == self.end else token % 3)

    def rollback(self, k: int) -> None:
        del self.states[-k:]

    def is_terminated(self) -> bool:
        return self.states[-1] == -1

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, idx: int) -> None:
        self.fills += 1
        vocab_mask[idx] = pack(self.allowed())

    def allocate_vocab_mask(self, vocab_size: int, batch_size: int, device: str) -> torch.Tensor:
        return torch.full((batch_size, math.ceil(vocab_size / 32)), -1, dtype=torch.int32)


@pytest.fixture(scope="module")
def grammar_module(decode_tool: ModuleType) -> ModuleType:
    return decode_tool.load_overlay_module(GRAMMAR, "sglang/srt/speculative/ddtree_grammar.py")


@pytest.fixture(scope="module")
def dd(decode_tool: ModuleType) -> ModuleType:
    """The newest ddtree_utils.py (the tree build, links and walk the round runs)."""
    return decode_tool.load_overlay_module(GRAMMAR, decode_tool.DDTREE_UTILS)


@pytest.fixture(scope="module")
def sglang_bitmask() -> Callable[..., torch.Tensor]:
    """0.5.17's ``generate_token_bitmask`` and ``traverse_tree``: the whole tree's masks."""
    names = {"torch": torch, "time": __import__("time"), "logger": SimpleNamespace(warning=print),
             "TREE_TRAVERSE_TIME_THRESHOLD": 1, "List": list, "Optional": Any, "Tuple": tuple,
             "Req": Any, "BaseGrammarObject": Any}
    namespace = lift_release("sglang/srt/speculative/spec_utils.py", ["traverse_tree", "generate_token_bitmask"], names)

    def bitmask(grammars: list[ModGrammar | None], next_token, next_sibling, ids) -> torch.Tensor:
        reqs = [SimpleNamespace(grammar=g) for g in grammars]
        mask, _ = namespace["generate_token_bitmask"](reqs, next_token, next_sibling, ids, VOCAB)
        return mask

    return bitmask


def tree_round(dd: ModuleType, seed: int, bs: int, budget: int, follow: float = 0.75):
    """A batch of trees from random draft logits, their links and verify ids, and target logits
    whose top token is, with probability ``follow``, one of the node's children's tokens."""
    g = torch.Generator().manual_seed(seed)
    tree = dd.build_ddtree_batch(torch.randn(bs, DEPTHS, VOCAB, generator=g) * 3, budget)
    _, next_token, next_sibling = dd.tree_links(tree)
    ids = torch.cat([torch.zeros(bs, 1, dtype=torch.int64), tree.tokens], dim=1)
    logits = torch.randn(bs, budget + 1, VOCAB, generator=g)
    for b in range(bs):
        for node in range(budget + 1):
            children = (tree.parents[b] == node).nonzero().flatten()
            children = children[children <= int(tree.num_nodes[b])]
            if len(children) and float(torch.rand((), generator=g)) < follow:
                child = children[int(torch.randint(len(children), (), generator=g))]
                logits[b, node, ids[b, child]] += 8.0
    return tree, next_token, next_sibling, ids, logits


def masked(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The logits with every token the bitmask refuses at -inf (rows: the flattened nodes)."""
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    return flat.masked_fill(~unpack(mask, vocab), float("-inf")).view(logits.shape)


@pytest.mark.parametrize("budget", [16, 64])
def test_greedy_walk_equals_the_fully_masked_tree(dd: ModuleType, grammar_module: ModuleType,
                                                  sglang_bitmask: Callable[..., torch.Tensor], budget: int) -> None:
    repicked = fills_lazy = fills_full = 0
    for seed in range(12):
        bs = 4
        tree, next_token, next_sibling, ids, logits = tree_round(dd, seed, bs, budget)
        states = [seed % 3, (seed + 1) % 3, None, (seed + 2) % 3]
        end = 5 if seed % 4 == 0 else None  # some grammars end inside the tree
        full = [None if s is None else ModGrammar(s, end=end) for s in states]
        want_picks = masked(logits, sglang_bitmask(full, next_token, next_sibling, ids)).argmax(-1)
        want_lens, want_path = dd.follow_verified_tree_batch(tree, want_picks)

        lazy = [None if s is None else ModGrammar(s, end=end) for s in states]
        picks = logits.argmax(-1)
        vocab_mask = ModGrammar().allocate_vocab_mask(VOCAB, picks.numel(), "cpu")

        def repick(rows: list[int], logits: torch.Tensor = logits, vocab_mask: torch.Tensor = vocab_mask) -> list[int]:
            return masked(logits, vocab_mask).reshape(-1, VOCAB).argmax(-1)[rows].tolist()

        changed = grammar_module.ddtree_grammar_picks(lazy, next_token=next_token, next_sibling=next_sibling, ids=ids,
                                                      picks=picks, vocab_mask=vocab_mask, repick=repick)
        lens, path = dd.follow_verified_tree_batch(tree, picks)
        assert torch.equal(lens, want_lens) and torch.equal(path, want_path), f"seed {seed}"
        assert torch.equal(picks.gather(1, path), want_picks.gather(1, path)), f"seed {seed}: picks on the path"
        for b, grammar in enumerate(lazy):
            if grammar is not None:
                assert grammar.states == [states[b]], "the walk must roll its grammar back"
                assert grammar.fills <= int(lens[b]), "at most one fill per node of the path"
        repicked += len(changed)
        fills_lazy += sum(g.fills for g in lazy if g is not None)
        fills_full += sum(g.fills for g in full if g is not None)
    assert repicked > 0, "no pick was refused: the test did not reach the repick"
    assert fills_lazy < fills_full / 2, (fills_lazy, fills_full)


def committed(tree, picks: torch.Tensor, ids: torch.Tensor, dd: ModuleType) -> list[tuple[int, ...]]:
    """Per row: the accepted nodes' tokens and the next token."""
    lens, path = dd.follow_verified_tree_batch(tree, picks)
    rows = []
    for b in range(picks.shape[0]):
        nodes = path[b, : int(lens[b])]
        rows.append((*ids[b, nodes[1:]].tolist(), int(picks[b, nodes[-1]])))
    return rows


@pytest.mark.parametrize("top_k", [None, 3])
def test_sampled_walk_follows_the_masked_distribution(dd: ModuleType, grammar_module: ModuleType, decode_tool: ModuleType,
                                                      sglang_bitmask: Callable[..., torch.Tensor], top_k: int | None) -> None:
    """Temperature alone: allowed draws stand (the control ignores the grammar). Top-k 3, a
    truncating sampler: the walk must draw every path pick again (the control keeps allowed draws)."""
    # Flatter under top-k, so that where the cut falls changes the commits the wrong walk makes.
    rows, budget, temperature = 3000, 16, 1.5 if top_k is None else 4.0
    tree1, next_token1, next_sibling1, ids1, logits1 = tree_round(dd, 3, 1, budget, follow=1.0)
    expand = lambda t: t.expand(rows, *t.shape[1:]).contiguous()  # noqa: E731
    tree = dd.build_ddtree_batch(torch.randn(1, DEPTHS, VOCAB, generator=torch.Generator().manual_seed(3)).mul(3)
                                 .expand(rows, -1, -1), budget)
    assert torch.equal(tree.tokens[0], tree1.tokens[0])
    next_token, next_sibling, ids, logits = map(expand, (next_token1, next_sibling1, ids1, logits1))
    g = torch.Generator().manual_seed(11)

    def sample(node_logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
        """SGLang's order: the grammar's mask on the logits, then the sampler's cut, then the draw."""
        flat = node_logits.reshape(-1, VOCAB)
        if allowed is not None:
            flat = flat.masked_fill(~allowed.reshape(-1, VOCAB), float("-inf"))
        if top_k is not None:
            flat = flat.masked_fill(flat < flat.topk(top_k, dim=-1).values[:, -1:], float("-inf"))
        return torch.multinomial(torch.softmax(flat / temperature, -1), 1, generator=g).view(node_logits.shape[:-1])

    full_mask = sglang_bitmask([ModGrammar(1)], next_token1, next_sibling1, ids1).repeat(rows, 1)
    want = committed(tree, sample(logits, unpack(full_mask, VOCAB)), ids, dd)

    def walk(redraw: bool | None) -> list[tuple[int, ...]]:
        picks = sample(logits, None)
        if redraw is None:  # the grammar ignored
            return committed(tree, picks, ids, dd)
        vocab_mask = ModGrammar().allocate_vocab_mask(VOCAB, picks.numel(), "cpu")

        def repick(flat_rows: list[int]) -> list[int]:
            return sample(logits.reshape(-1, VOCAB)[flat_rows], unpack(vocab_mask[flat_rows], VOCAB)).tolist()

        grammars = [ModGrammar(1) for _ in range(rows)]
        assert grammar_module.ddtree_grammar_picks(grammars, next_token=next_token, next_sibling=next_sibling, ids=ids,
                                                   picks=picks, vocab_mask=vocab_mask, repick=repick,
                                                   redraw=[redraw] * rows)
        return committed(tree, picks, ids, dd)

    got, control = walk(top_k is not None), walk(None if top_k is None else False)
    keys = {key: i for i, key in enumerate(sorted(set(want + got + control)))}
    _, _, p_value = decode_tool.chi_square([keys[k] for k in want], [keys[k] for k in got])
    _, _, p_control = decode_tool.chi_square([keys[k] for k in want], [keys[k] for k in control])
    assert p_value > 1e-3, f"rc.14's sampled commits differ from the fully masked tree's (p = {p_value:.2e})"
    assert p_control < 1e-6, f"the test cannot tell the wrong walk apart (p = {p_control:.2e})"


class ConstrainedGreedy:
    """Plain constrained greedy decoding's pick (and the decode loop's first token): the argmax
    among the tokens the grammar allows, then the grammar takes it."""

    def __init__(self, grammar: ModGrammar) -> None:
        self.grammar = grammar

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        pick = logits.masked_fill(~self.grammar.allowed(), float("-inf")).argmax(-1)
        self.grammar.accept_token(int(pick.reshape(-1)[0]))
        return pick


def grammar_walk(dd: ModuleType, grammar_module: ModuleType, grammar: ModGrammar) -> Callable[..., Any]:
    """The decode tool's walk with rc.14's grammar picks, the grammar then taking the committed tokens."""

    def walk(tree, logits: torch.Tensor, draft_logits: torch.Tensor) -> tuple[torch.Tensor, int]:
        _, next_token, next_sibling = dd.tree_links(tree)
        ids = torch.cat([torch.zeros(1, 1, dtype=torch.int64), tree.tokens], dim=1)
        picks = logits.argmax(-1)[None]
        vocab_mask = grammar.allocate_vocab_mask(logits.shape[-1], picks.numel(), "cpu")

        def repick(rows: list[int]) -> list[int]:
            return masked(logits, vocab_mask).argmax(-1)[rows].tolist()

        grammar_module.ddtree_grammar_picks([grammar], next_token=next_token, next_sibling=next_sibling, ids=ids,
                                            picks=picks, vocab_mask=vocab_mask, repick=repick)
        lens, path = dd.follow_verified_tree_batch(tree, picks)
        accepted = path[0, : int(lens[0])]
        for token in [*ids[0, accepted[1:]].tolist(), int(picks[0, accepted[-1]])]:
            grammar.accept_token(token)
        return accepted, int(picks[0, accepted[-1]])

    return walk


@pytest.mark.parametrize("budget", [16, 64])
def test_constrained_decode_equals_plain_constrained_greedy(dd: ModuleType, grammar_module: ModuleType,
                                                            decode_tool: ModuleType, budget: int) -> None:
    target, drafter_for = decode_tool.make_copy_pair()
    vocab, constrained = decode_tool.VOCAB, 0
    for name, prompt in decode_tool.prompts("copy"):
        want = decode_tool.sample_generate(target, prompt, 40, ConstrainedGreedy(ModGrammar(0, vocab)))[0]
        constrained += want != decode_tool.greedy_generate(target, prompt, 40)
        grammar = ModGrammar(0, vocab)
        got = decode_tool.ddtree_generate(target, drafter_for(prompt, want), prompt, 40, budget,
                                          sampler=ConstrainedGreedy(grammar),
                                          walk=grammar_walk(dd, grammar_module, grammar))
        assert got.tokens == want, f"{name} at budget {budget}"
    assert constrained >= 3, "the grammar changed too few of the copy pair's decodes to test anything"


def test_debug_records(dd: ModuleType, decode_tool: ModuleType) -> None:
    """rc.13's ``ddtree_debug_records`` (moved out of the worker): one record per request (the decode
    tool loads rc.14's ``ddtree_debug`` with rc.14's own ``ddtree_utils`` beside it)."""
    debug = decode_tool.load_overlay_module(RC14, "sglang/srt/speculative/ddtree_debug.py")
    tree, _, _, ids, logits = tree_round(dd, 5, 3, 16)
    picks = logits.argmax(-1)
    plan = dd.ddtree_commit_plan(tree, picks, ids, torch.full((3,), 10))
    draft_top1 = torch.randint(VOCAB, (3, DEPTHS), generator=torch.Generator().manual_seed(1))
    records = debug.ddtree_debug_records(tree, picks, plan, draft_top1)
    assert [r["tree_nodes"] for r in records] == tree.num_nodes.tolist()
    assert [r["accept_length"] for r in records] == plan.commit_lens.tolist()
    assert [r["accepted_nodes"] for r in records] == (plan.commit_lens - 1).tolist()
    depths = [int(tree.depths[b, : int(tree.num_nodes[b])].max()) for b in range(3)]
    assert [r["tree_depth"] for r in records] == depths
    agree = dd.draft_top1_agreement(draft_top1, picks, plan.path, plan.commit_lens.to(torch.int64)).tolist()
    assert [r["draft_top1_agree"] for r in records] == agree
    assert all(r["budget"] == 16 for r in records)


def test_a_repick_the_grammar_still_refuses_ends_the_walk(dd: ModuleType, grammar_module: ModuleType) -> None:
    """Where a grammar allows nothing at a node, the masked logits' own pick stands and the walk ends
    there without handing it to the grammar (SGLang's scheduler then refuses it, as upstream)."""
    tree, next_token, next_sibling, ids, logits = tree_round(dd, 0, 1, 16, follow=1.0)
    grammar = ModGrammar(0)
    grammar.allowed = lambda: torch.zeros(VOCAB, dtype=torch.bool)  # type: ignore[method-assign]
    picks = logits.argmax(-1)
    vocab_mask = grammar.allocate_vocab_mask(VOCAB, picks.numel(), "cpu")
    changed = grammar_module.ddtree_grammar_picks([grammar], next_token=next_token, next_sibling=next_sibling, ids=ids,
                                                  picks=picks, vocab_mask=vocab_mask, repick=lambda rows: [0] * len(rows))
    assert changed == [0] and int(picks[0, 0]) == 0 and grammar.states == [0] and grammar.fills == 1


def sampling(top_ks: list[int], top_ps: list[float], min_ps: list[float] | None = None) -> SimpleNamespace:
    """The fields of SGLang's SamplingBatchInfo that the redraw rule reads."""
    return SimpleNamespace(is_all_greedy=all(k == 1 for k in top_ks) and min_ps is None, top_ks=torch.tensor(top_ks),
                           top_ps=torch.tensor(top_ps), need_min_p_sampling=min_ps is not None,
                           min_ps=torch.tensor(min_ps or [0.0] * len(top_ks)))


def test_truncating_samplers_are_the_ones_that_cut(grammar_module: ModuleType) -> None:
    """top-k above 1 and below V, top-p, min-p cut the distribution (their walks redraw every pick);
    top-k 1 (greedy), top-k V and temperature alone do not; an all-greedy batch gives None."""
    rule = grammar_module.ddtree_truncating_samplers
    assert rule(sampling([1, 1], [1.0, 1.0]), VOCAB) is None
    assert rule(sampling([20, 1, VOCAB, VOCAB], [1.0, 1.0, 1.0, 0.9]), VOCAB) == [True, False, False, True]
    assert rule(sampling([VOCAB, VOCAB], [1.0, 1.0], [0.0, 0.05]), VOCAB) == [False, True]


@pytest.mark.parametrize(("backend", "refused"), [("xgrammar", False), ("llguidance", False), (None, False),
                                                  ("none", False), ("outlines", True)])
def test_grammar_backend_refusal(grammar_module: ModuleType, backend: str | None, refused: bool) -> None:
    reason = grammar_module.ddtree_grammar_backend_refusal(backend)
    assert (reason is not None) == refused
    if refused:
        assert "--grammar-backend outlines" in reason and "xgrammar" in reason


def _method(spec: str, path: str, cls: str, name: str) -> ast.FunctionDef | None:
    source = load_overlay(spec, OVERLAYS).content_of(path, None).decode()
    klass = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == cls)
    return next((n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name == name), None)


def test_rc15_keeps_grammar_batches_on_the_overlap_scheduler() -> None:
    """rc.15's algorithm says it supports grammar overlap (rc.14's inherits SGLang's CustomSpecAlgo
    "no"), which is safe only because the worker runs the scheduler's barrier before it reads any
    request's grammar. (The scheduler side is SGLang's; this reads the overlay's own source.)"""
    spec = "sglang/srt/speculative/ddtree_spec.py"
    assert _method(RC14, spec, "DDTreeSpecAlgo", "supports_grammar_overlap") is None
    method = _method("ddtree@0.3.0-rc.15", spec, "DDTreeSpecAlgo", "supports_grammar_overlap")
    assert method is not None and ast.unparse(method.body[-1]) == "return True"
    walk = _method("ddtree@0.3.0-rc.15", "sglang/srt/speculative/ddtree_worker_v2.py", "DDTreeWorkerV2", "_grammar_picks")
    assert walk is not None
    lines = {(type(n).__name__, ast.unparse(n)): n.lineno for n in ast.walk(walk)
             if (isinstance(n, ast.Call) and ast.unparse(n.func) == "barrier")
             or (isinstance(n, ast.Attribute) and n.attr == "grammar")}
    barrier = [line for (kind, _), line in lines.items() if kind == "Call"]
    reads = [line for (kind, _), line in lines.items() if kind == "Attribute"]
    assert barrier and reads and max(barrier) < min(reads), "the barrier must run before any grammar is read"
