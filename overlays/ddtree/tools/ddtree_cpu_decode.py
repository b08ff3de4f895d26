"""CPU reference decode loop for DDTree: a tiny transformers Qwen3 target, a drafter that emits
``[L, V]`` logits, the whole tree verified in one forward pass, and the acceptance table.

One round: draft from the committed context, build the tree (``build_ddtree_batch``), verify
``[bonus] + nodes`` in one target forward (4-D tree mask, positions ``start + depth``), walk
the target's greedy picks (``follow_verified_tree_batch``), keep the accepted KV entries and
hidden features, repeat. At T = 0 the output must equal the target's own greedy decoding.

Two model pairs, built in-process (nothing is downloaded):

- ``random``: a random Qwen3 with a large-margin lm_head, and a drafter that hides the
  target's greedy continuation in random logits (at rank 0, a low rank, or not at all).
- ``copy``: the hand-set pair of ../../../shared/gpu/scripts/make_models.py, rebuilt here in
  fp32. The target's layers are identities and its lm_head makes the greedy next token
  ``f(t)``: ``t`` on the first and third quarters of the vocabulary, ``t xor 1`` on the second,
  ``t - V/4`` on the fourth. The drafter proposes the (count-weighted) majority token of the
  context at every depth, so repeated prompts are drafted right, and on alternating prompts
  (second quarter) its top two tokens nearly tie: there a tree beats the chain.

At T > 0 (``Sampler(temperature, generator)``) the target's pick at every tree node is an
independent draw from softmax(logits / T), the walk follows the child holding it (DDTREE.md),
and ``sample_generate`` is plain sampling, one forward per token, many rows at once; a ``walk``
argument replaces the reference walk (the tests plant wrong rules with it), and ``chi_square``
compares two samples of tokens.

Run ``python overlays/ddtree/tools/ddtree_cpu_decode.py`` to print acceptance lengths per
budget against a chain (budget = L, rank-0 children only); ``--json FILE [--pair copy]
[--budgets 16,64]`` writes one pair's decodes in the online bench's JSON schema instead. It runs
the newest ddtree version's ``ddtree_utils.py`` (ddtree-deploy resolves it through ``inherits``;
install it first).
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM

# The overlays folder holding ddtree/ (the repository's, or the built-ins of an installed ddtree-deploy).
OVERLAYS = Path(__file__).resolve().parents[2]
DDTREE_UTILS = "sglang/srt/speculative/ddtree_utils.py"
BLOCK_SIZE = 8  # as make_models.py's drafter: L = 7 draft depths
VOCAB = 512
HIDDEN = 128
# Target layer whose output feeds the drafter (make_models.py: layer 1 of the target).
FEATURE_LAYER = 2

# A drafter maps (committed tokens, ending with the bonus; target features of the tokens
# before the bonus) to draft logits [L, V].
Drafter = Callable[[List[int], torch.Tensor], torch.Tensor]
# A pair is a target and a drafter factory taking (prompt, the target's greedy continuation).
Pair = Tuple[Qwen3ForCausalLM, Callable[[List[int], List[int]], Drafter]]
# A walk maps (the round's tree batch of one request, the target's logits at [root] + nodes [n + 1, V],
# the draft logits [L, V]) to the accepted node indices from the root [1 + accepted] and the next token.
Walk = Callable[[Any, torch.Tensor, torch.Tensor], Tuple[torch.Tensor, int]]


def load_ddtree_utils(spec: str = "ddtree") -> ModuleType:
    """Import the ddtree_utils.py that version ``spec`` lands (default: the newest release), resolved
    through ``inherits`` and ``edits`` by ddtree-deploy's own loader: one module per version, no sglang needed."""
    return load_overlay_module(spec, DDTREE_UTILS)


@contextlib.contextmanager
def modules_restored(names: Iterable[str]) -> Iterator[None]:
    """``sys.modules``' entries for ``names`` as they were before the block, whatever it registers."""
    saved = {name: sys.modules.get(name) for name in names}
    try:
        yield
    finally:
        for name, before in saved.items():
            if before is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = before


_LOADING: List[str] = []  # the modules being loaded, outermost first: a sibling cycle is an error, not a hang


@functools.lru_cache(maxsize=None)  # resolving a version runs GNU patch: once per module, not per decode
def load_overlay_module(spec: str, path: str) -> ModuleType:
    """Import the torch-only module at ``path`` (inside the sglang package) as version ``spec`` lands it.

    The sglang modules it imports at its top that the version itself ships (a module split in two,
    0.3.0-rc.18's ``ddtree_utils.py``) are that version's, loaded the same way and seen under their
    sglang names only while it runs, so two versions' siblings never meet. A module that fails to
    load is not left behind.
    """
    from ddtree_deploy.catalog import load_overlay

    overlay = load_overlay(spec, OVERLAYS)
    name = re.sub(r"\W", "_", f"{Path(path).stem}_{overlay.version}")
    if name in sys.modules:
        return sys.modules[name]
    if name in _LOADING:
        raise ImportError(f"{overlay.label}: circular sibling imports: {' -> '.join([*_LOADING, name])}")
    _LOADING.append(name)
    try:
        source = overlay.content_of(path, None)
        siblings = {imported: load_overlay_module(spec, f"{imported.replace('.', '/')}.py")
                    for imported in re.findall(r"^from (sglang\.[\w.]+) import", source.decode(), re.M)
                    if f"{imported.replace('.', '/')}.py" in overlay.manifest.files}
        module = ModuleType(name)
        module.__file__ = f"{overlay.label}:{path}"
        sys.modules[name] = module  # dataclasses resolve annotations through sys.modules
        with modules_restored(siblings):
            sys.modules.update(siblings)
            try:
                exec(compile(source, module.__file__, "exec"), module.__dict__)
            except BaseException:
                sys.modules.pop(name, None)
                raise
    finally:
        _LOADING.pop()
    return module


# --------------------------------------------------------------------------- models
def _config(num_layers: int) -> Qwen3Config:
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "eager"  # eager attention takes an additive 4-D mask
    return config


def _rms_norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def make_random_pair(seed: int = 0) -> Pair:
    """Random target (large lm_head, so greedy picks are well separated) and a noisy drafter.

    The drafter knows the target's greedy continuation and hides it in random logits: at
    each depth the right token gets a boost that makes it rank 0, a low rank, or nothing, so
    rounds accept chains, siblings and nothing, on a target whose attention matters.
    """
    torch.manual_seed(seed)
    target = Qwen3ForCausalLM(_config(num_layers=2)).eval()
    with torch.no_grad():
        target.lm_head.weight.normal_(0.0, 1.0)

    def drafter_for(prompt: List[int], continuation: List[int]) -> Drafter:
        full = list(prompt) + list(continuation)

        def draft(tokens: List[int], features: torch.Tensor) -> torch.Tensor:
            g = torch.Generator().manual_seed(seed * 100003 + len(tokens))
            logits = torch.randn(BLOCK_SIZE - 1, VOCAB, generator=g)
            # Confident when right (rank 0, p ~ 0.9), else a low rank, else nothing.
            pick = torch.multinomial(torch.tensor([0.6, 0.25, 0.15]), BLOCK_SIZE - 1, True, generator=g)
            boost = torch.tensor([9.0, 3.0, 0.0])[pick]
            for depth in range(BLOCK_SIZE - 1):
                if len(tokens) + depth < len(full):
                    logits[depth, full[len(tokens) + depth]] += float(boost[depth])
            return logits

        return draft

    return target, drafter_for


def make_copy_pair(seed: int = 2) -> Pair:
    """The hand-set pair: identity target with greedy next token f(t), majority drafter."""
    torch.manual_seed(seed)
    target = Qwen3ForCausalLM(_config(num_layers=2)).eval()
    q = VOCAB // 4
    with torch.no_grad():
        emb = torch.randn(VOCAB, HIDDEN)
        target.model.embed_tokens.weight.copy_(emb)
        for layer in target.model.layers:  # zero outputs: the residual keeps e_t
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head = emb.clone()  # logit_j(t) = norm(e_t) . head_j, largest at j = f(t)
        second = torch.arange(q, 2 * q)
        head[second ^ 1] = emb[second]
        head[2 * q : 3 * q] = emb[2 * q : 3 * q] + emb[3 * q :]
        head[3 * q :] = 0.0
        target.lm_head.weight.copy_(head)
    half = HIDDEN // 2

    def draft(tokens: List[int], features: torch.Tensor) -> torch.Tensor:
        # Uniform attention over context + bonus, copying half of the normed features, then
        # the target's norm and lm_head: the count-weighted majority token, at every depth.
        rows = _rms_norm(torch.cat([features, emb[tokens[-1]][None]]))[:, :half]
        h = torch.zeros(HIDDEN)
        h[:half] = rows.mean(0)
        return (_rms_norm(h) @ head.T).expand(BLOCK_SIZE - 1, VOCAB).clone()

    return target, lambda prompt, continuation: draft


# --------------------------------------------------------------------------- decoding
@dataclass
class Decoded:
    """Tokens after the prompt and the acceptance length (1 + accepted nodes) of each round."""

    tokens: List[int]
    accept_lengths: List[int] = field(default_factory=list)

    @property
    def mean_accept_length(self) -> float:
        return sum(self.accept_lengths) / max(len(self.accept_lengths), 1)


def _one_row(rows: Tuple[torch.Tensor, torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """`_forward_rows`' answer for a batch of one row: logits [n, V] and the drafter's features [n, H]."""
    logits, features = rows
    return logits[0], features[0]


def _forward_rows(
    target: Qwen3ForCausalLM,
    ids: torch.Tensor,
    positions: torch.Tensor,
    cache: DynamicCache,
    mask: torch.Tensor | None = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rows of equal length: ids [rows, n], positions [1, n] (shared) or [rows, n]."""
    past = cache.get_seq_length()
    with warnings.catch_warnings():  # past_key_values: renamed in transformers 5.x, kept for 4.56+
        warnings.simplefilter("ignore", FutureWarning)
        out = target(
            input_ids=ids,
            position_ids=positions.expand(ids.shape[0], -1),
            attention_mask=mask,
            past_key_values=cache,
            cache_position=torch.arange(past, past + ids.shape[1]),
            use_cache=True,
            output_hidden_states=True,
        )
    return out.logits, out.hidden_states[FEATURE_LAYER]


@dataclass
class Sampler:
    """The target's pick from logits [..., V]: the argmax at temperature 0, else an independent draw
    from softmax(logits / temperature) for every row (every position, every tree node)."""

    temperature: float = 0.0
    generator: Optional[torch.Generator] = None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.temperature <= 0.0:
            return logits.argmax(-1)
        probs = self.probs(logits.reshape(-1, logits.shape[-1]))
        return torch.multinomial(probs, 1, generator=self.generator).view(logits.shape[:-1])

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """softmax(logits / temperature) in float64 (T > 0)."""
        return torch.softmax(logits.double() / self.temperature, dim=-1)


GREEDY = Sampler()


@torch.no_grad()
def greedy_generate(target: Qwen3ForCausalLM, prompt: Sequence[int], max_new_tokens: int) -> List[int]:
    """The target's own greedy tokens, one forward per token."""
    return sample_generate(target, prompt, max_new_tokens, GREEDY)[0]


@torch.no_grad()
def sample_generate(
    target: Qwen3ForCausalLM, prompt: Sequence[int], max_new_tokens: int, sampler: Sampler, rows: int = 1
) -> List[List[int]]:
    """Plain decoding, one forward per token: ``rows`` continuations of one prompt at once."""
    cache = DynamicCache()
    ids = torch.tensor(prompt).expand(rows, -1)
    logits, _ = _forward_rows(target, ids, torch.arange(len(prompt))[None], cache)
    tokens = sampler(logits[:, -1])[:, None]
    while tokens.shape[1] < max_new_tokens:
        position = torch.tensor([[len(prompt) + tokens.shape[1] - 1]])
        logits, _ = _forward_rows(target, tokens[:, -1:], position, cache)
        tokens = torch.cat([tokens, sampler(logits[:, -1])[:, None]], dim=1)
    return tokens.tolist()


def chi_square(a: Sequence[int], b: Sequence[int], min_pooled: int = 20) -> Tuple[float, int, float]:
    """Two-sample chi-square test of homogeneity of two samples of tokens: (statistic, df, p-value).
    Tokens drawn fewer than ``min_pooled`` times in both samples together share one bin, dropped if
    that bin is that rare too."""
    pooled = torch.bincount(torch.tensor(list(a) + list(b)))
    keep = (pooled >= min_pooled).nonzero().flatten()

    def counts(sample: Sequence[int]) -> torch.Tensor:
        c = torch.bincount(torch.tensor(list(sample)), minlength=pooled.numel()).double()
        return torch.cat([c[keep], (c.sum() - c[keep].sum()).view(1)])

    table = torch.stack([counts(a), counts(b)])
    if table[:, -1].sum() < min_pooled:
        table = table[:, :-1]
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    statistic = float(((table - expected) ** 2 / expected).sum())
    df = table.shape[1] - 1
    p_value = torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(statistic / 2))
    return statistic, df, float(p_value)


def _keep_accepted(cache: DynamicCache, start: int, accepted: torch.Tensor) -> None:
    """Move the accepted nodes' KV entries right after the committed prefix, drop the rest."""
    for layer in cache.layers:
        for name in ("keys", "values"):
            kv = getattr(layer, name)
            setattr(layer, name, torch.cat([kv[:, :, :start], kv[:, :, start + accepted]], dim=2))


def reference_walk(sampler: Sampler) -> Walk:
    """DDTREE.md's walk: the target's pick at every node, then from the root follow the child that
    holds the pick; the pick at the last accepted node is the next token."""

    def walk(tree: Any, logits: torch.Tensor, draft_logits: torch.Tensor) -> Tuple[torch.Tensor, int]:
        picks = sampler(logits)
        accept_lengths, path = load_ddtree_utils().follow_verified_tree_batch(tree, picks[None])
        accepted = path[0, : int(accept_lengths[0])]
        return accepted, int(picks[accepted[-1]])

    return walk


@torch.no_grad()
def ddtree_generate(
    target: Qwen3ForCausalLM,
    drafter: Drafter,
    prompt: Sequence[int],
    max_new_tokens: int,
    budget: int,
    chain: bool = False,
    sampler: Sampler = GREEDY,
    walk: Optional[Walk] = None,
) -> Decoded:
    """Speculative decoding with DDTree (or, with ``chain``, the DFlash chain: top-1 per depth);
    ``sampler`` picks the target's tokens, ``walk`` (default ``reference_walk(sampler)``) accepts."""
    dd = load_ddtree_utils()
    walk = walk or reference_walk(sampler)
    cache = DynamicCache()
    logits, features = _one_row(_forward_rows(target, torch.tensor(prompt)[None], torch.arange(len(prompt))[None], cache))
    out = Decoded(tokens=[int(sampler(logits[-1]))])
    while len(out.tokens) < max_new_tokens:
        start = cache.get_seq_length()  # the bonus token's position
        bonus = out.tokens[-1]
        draft_logits = drafter(list(prompt) + out.tokens, features)
        if chain:
            # Only each row's top token survives: the tree degenerates to the rank-0 chain.
            top = draft_logits.argmax(-1, keepdim=True)
            draft_logits = torch.full_like(draft_logits, -math.inf).scatter(
                -1, top, draft_logits.gather(-1, top)
            )
        tree = dd.build_ddtree_batch(draft_logits[None], budget)
        ids = torch.cat([torch.tensor([bonus]), tree.tokens[0]])
        visible = dd.tree_attention_mask(tree, start)[:, None]  # [1, 1, n + 1, start + n + 1]
        mask = torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)
        logits, node_features = _one_row(_forward_rows(target, ids[None], dd.tree_positions(tree, start), cache, mask))
        accepted, next_token = walk(tree, logits, draft_logits)
        _keep_accepted(cache, start, accepted)
        features = torch.cat([features, node_features[accepted]])
        out.tokens += ids[accepted[1:]].tolist() + [next_token]
        out.accept_lengths.append(int(accepted.shape[0]))
    out.tokens = out.tokens[:max_new_tokens]
    return out


# --------------------------------------------------------------------------- the table
PAIRS: Dict[str, Callable[[], Pair]] = {"random": make_random_pair, "copy": make_copy_pair}


def prompts(pair: str) -> List[Tuple[str, List[int]]]:
    """Named prompts; ``copy`` ones exercise each region of f (token 0 included)."""
    q = VOCAB // 4
    if pair == "copy":
        return [
            ("repeat-0", [0] * 6),
            ("repeat", [37] * 6),
            ("alternate", [q + 10, q + 11] * 3),
            ("alternate-2", [q + 40, q + 41, q + 40, q + 41, q + 40]),
            ("shift", [3 * q + 5] * 4),
        ]
    g = torch.Generator().manual_seed(7)
    return [(f"random-{i}", torch.randint(0, VOCAB, (8,), generator=g).tolist()) for i in range(3)]


def acceptance_table(
    budgets: Sequence[int] = (1, 4, 16, 64), max_new_tokens: int = 32
) -> List[Tuple[str, str, str, float, bool]]:
    """(pair, prompt, method, mean acceptance length, lossless) for every combination."""
    rows = []
    for pair, make in PAIRS.items():
        target, drafter_for = make()
        for name, prompt in prompts(pair):
            reference = greedy_generate(target, prompt, max_new_tokens)
            drafter = drafter_for(prompt, reference)
            runs = [(f"chain(L={BLOCK_SIZE - 1})", BLOCK_SIZE - 1, True)]
            runs += [(f"B={b}", b, False) for b in budgets]
            for method, budget, chain in runs:
                got = ddtree_generate(target, drafter, prompt, max_new_tokens, budget, chain)
                rows.append((pair, name, method, got.mean_accept_length, got.tokens == reference))
    return rows


def bench_results(pair: str, budgets: Sequence[int], max_new_tokens: int) -> Dict[str, object]:
    """One pair's decodes as the online bench's JSON (ddtree_deploy/benchmark/results.py, docs/bench.md):
    variant ``dflash`` is the chain, ``ddtree@B`` each budget, one greedy batch-1 run each, with every
    prompt's rounds, so ``ddtree-deploy bench --baseline`` can hold a server against it."""
    from ddtree_deploy.benchmark.results import BenchResults, RequestStats, RunResult, VariantResult, acceptance_of

    target, drafter_for = PAIRS[pair]()
    named = prompts(pair)
    runs: Dict[str, List[RequestStats]] = {}
    for index, (_, prompt) in enumerate(named):
        reference = greedy_generate(target, prompt, max_new_tokens)
        drafter = drafter_for(prompt, reference)
        for variant, budget, chain in [("dflash", BLOCK_SIZE - 1, True)] + [(f"ddtree@{b}", b, False) for b in budgets]:
            got = ddtree_generate(target, drafter, prompt, max_new_tokens, budget, chain)
            if got.tokens != reference:
                raise SystemExit(f"{pair} {variant}: prompt {index} is not lossless")
            counts = [got.accept_lengths.count(b) for b in range(1, BLOCK_SIZE + 1)]
            runs.setdefault(variant, []).append(RequestStats(
                prompt=index, completion_tokens=len(got.tokens), rounds=len(got.accept_lengths), accept_counts=counts))
    variants = [VariantResult(variant=name, algorithm="DFLASH" if name == "dflash" else "DDTREE",
                              budget=None if name == "dflash" else int(name.split("@")[1]), runs=[RunResult(
                                  mode="greedy", batch=1, temperature=0.0, requests=requests,
                                  completion_tokens=sum(r.completion_tokens for r in requests), elapsed_s=0.0,
                                  tokens_per_s=0.0, acceptance=acceptance_of(requests, BLOCK_SIZE))])
                for name, requests in runs.items()]
    return BenchResults(source="ddtree_cpu_decode", model=f"{pair} pair (CPU, fp32)", block_size=BLOCK_SIZE,
                        max_new_tokens=max_new_tokens, batch=1, prompts=[p for _, p in named], variants=variants,
                        note="offline: no timing (tokens/s 0)").model_dump(mode="json", by_alias=True)


def main(argv: Sequence[str] | None = None) -> None:
    import argparse
    import json

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", metavar="FILE", help="write one pair's decodes in the bench's JSON schema")
    parser.add_argument("--pair", choices=sorted(PAIRS), default="copy", help="the pair --json decodes")
    parser.add_argument("--budgets", default="1,4,16,64", help="comma-separated tree budgets")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    options = parser.parse_args(argv)
    torch.set_num_threads(1)  # tiny matrices: extra threads only contend
    budgets = [int(b) for b in options.budgets.split(",")]
    if options.json:
        results = bench_results(options.pair, budgets, options.max_new_tokens)
        Path(options.json).write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {options.json}: {options.pair} pair, {len(results['variants'])} variants")  # type: ignore[arg-type]
        return
    rows = acceptance_table(budgets, options.max_new_tokens)
    methods = list(dict.fromkeys(r[2] for r in rows))
    print(f"{'pair':7} {'prompt':12} " + " ".join(f"{m:>11}" for m in methods))
    for key in dict.fromkeys((r[0], r[1]) for r in rows):
        cells = [r for r in rows if (r[0], r[1]) == key]
        print(
            f"{key[0]:7} {key[1]:12} "
            + " ".join(f"{r[3]:>10.2f}{'' if r[4] else '!'}" for r in cells)
        )
    print("acceptance length = 1 + accepted nodes per round; '!' marks a lossless failure")
    if not all(r[4] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
