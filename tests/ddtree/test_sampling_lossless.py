"""DDTree at T > 0 is lossless in distribution: the reference rule (an independent sample from
softmax(logits / T) at every tree node, then follow the child holding it; DDTREE.md) against plain
sampling, on CPU fp32, with a two-sample chi-square test per position.

The pair: a 2-layer transformers Qwen3 whose residual stream is dominated by the token embedding, so
the target is close to a Markov chain (four likely successors per token, graded) with a little help
from attention, and a drafter that proposes the Markov chain's marginal at every depth (at T = 1, as
a trained drafter would). Trees then accept several nodes per round, side branches included.
Seeded and deterministic: the statistics printed by ``pytest -s`` are the ones in
overlays/ddtree/README.md ("Sampling at T > 0 (0.3.0-rc.2)"). Two planted wrong rules, draft-probability rejection
``min(1, p / q)`` over the tree's children with the draft at T = 1 and at the request's temperature,
must fail the same test.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import torch

TEMPERATURE = 0.8
PROMPT = [3, 17, 99, 250, 7, 42]
POSITIONS = 4  # tokens compared: the prefill's sample, then three drawn through trees
N_PLAIN = 4000
N_TREE = 1000
N_PLANTED = 200
P_MIN = 1e-3  # a lossless method must pass at every position, a planted wrong rule must fail somewhere
STRENGTHS = (6.0, 5.6, 5.2, 4.5)  # logits of each token's four successors, before the temperature


def markov_pair(tool: ModuleType) -> tuple[Any, Callable[[list[int], torch.Tensor], torch.Tensor]]:
    """The target (tool's Qwen3 config, embeddings of norm ~sqrt(H), lm_head voting for successors)
    and the drafter of its Markov approximation."""
    vocab, hidden = tool.VOCAB, tool.HIDDEN
    torch.manual_seed(5)
    target = tool.Qwen3ForCausalLM(tool._config(num_layers=2)).eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        emb = torch.randn(vocab, hidden, generator=g)
        target.model.embed_tokens.weight.copy_(emb)
        normed = tool._rms_norm(emb)
        head = torch.zeros(vocab, hidden)
        for token in range(vocab):
            for successor, strength in zip(torch.randperm(vocab, generator=g)[:4].tolist(), STRENGTHS, strict=True):
                head[successor] += strength * normed[token] / hidden
        target.lm_head.weight.copy_(head)
        transition = torch.softmax(normed @ head.T, dim=-1)

    def draft(tokens: list[int], features: torch.Tensor) -> torch.Tensor:
        rows, marginal = [], transition[tokens[-1]]
        for _ in range(tool.BLOCK_SIZE - 1):
            rows.append(marginal)
            marginal = marginal @ transition
        return torch.stack(rows).log()

    return target, draft


def rejection_walk(tool: ModuleType, draft_temperature: float) -> Callable[[Any], Any]:
    """A planted wrong rule (DDTREE.md: "applying min(1, p/q) to a top-K tree is biased"): from the
    root, try the children in order and accept one with probability min(1, p / q), p the target's
    probability at the node, q the draft's at that depth (at ``draft_temperature``); if none is
    accepted, the next token is drawn from p at the node."""

    def walk_for(sampler: Any) -> Any:
        def walk(tree: Any, logits: torch.Tensor, draft_logits: torch.Tensor) -> tuple[torch.Tensor, int]:
            one = tree.tree(0)
            p = sampler.probs(logits)
            q = torch.softmax(draft_logits.double() / draft_temperature, dim=-1)
            children: dict[int, list[tuple[int, int]]] = {}
            for (parent, token), child in sorted(one.child_map.items(), key=lambda kv: kv[1]):
                children.setdefault(parent, []).append((child, token))
            path = [0]
            while True:
                for child, token in children.get(path[-1], []):
                    depth = int(one.depths[child - 1])
                    ratio = float(p[path[-1], token] / q[depth - 1, token])
                    if float(torch.rand((), generator=sampler.generator, dtype=torch.float64)) < min(1.0, ratio):
                        path.append(child)
                        break
                else:
                    return torch.tensor(path), int(torch.multinomial(p[path[-1]], 1, generator=sampler.generator))

        return walk

    return walk_for


@pytest.fixture(scope="module")
def pair(decode_tool: ModuleType) -> tuple[Any, Any]:
    return markov_pair(decode_tool)


@pytest.fixture(scope="module")
def plain(decode_tool: ModuleType, pair: tuple[Any, Any]) -> list[list[int]]:
    sampler = decode_tool.Sampler(TEMPERATURE, torch.Generator().manual_seed(0))
    return decode_tool.sample_generate(pair[0], PROMPT, POSITIONS, sampler, rows=N_PLAIN)


def tree_samples(tool: ModuleType, pair: tuple[Any, Any], method: str, n: int, walk_for: Any = None,
                 seed: int = 1, sampler_for: Callable[[torch.Generator], Any] | None = None
                 ) -> tuple[list[list[int]], float]:
    """``n`` seeded continuations by ``method`` (``ddtree@B`` or ``dflash``, the chain) and the mean
    acceptance length; ``sampler_for(generator)`` picks the target's tokens (default: the
    temperature alone)."""
    target, draft = pair
    chain = method == "dflash"
    budget = tool.BLOCK_SIZE - 1 if chain else int(method.split("@")[1])
    rows, accepts = [], []
    for i in range(n):
        generator = torch.Generator().manual_seed(seed * 100_000 + i)
        sampler = sampler_for(generator) if sampler_for else tool.Sampler(TEMPERATURE, generator)
        got = tool.ddtree_generate(target, draft, PROMPT, POSITIONS, budget, chain=chain, sampler=sampler,
                                   walk=walk_for(sampler) if walk_for else None)
        rows.append(got.tokens)
        accepts += got.accept_lengths
    return rows, sum(accepts) / len(accepts)


def compare(tool: ModuleType, label: str, rows: list[list[int]], plain: list[list[int]],
            accept: float) -> list[float]:
    """Print the chi-square of every position against plain sampling; return the p-values."""
    p_values = []
    for position in range(POSITIONS):
        statistic, df, p_value = tool.chi_square([r[position] for r in rows], [r[position] for r in plain])
        print(f"{label}: position {position + 1}: chi2 {statistic:.2f}, df {df}, p {p_value:.3g}")
        p_values.append(p_value)
    print(f"{label}: {len(rows)} continuations, mean acceptance length {accept:.2f}")
    return p_values


@pytest.mark.parametrize(("method", "n", "seed"),
                         [("ddtree@16", N_TREE, 1), ("ddtree@64", N_TREE // 2, 4), ("dflash", N_TREE // 2, 5)])
def test_tree_sampling_follows_the_targets_distribution(decode_tool: ModuleType, pair: tuple[Any, Any],
                                                       plain: list[list[int]], method: str, n: int,
                                                       seed: int) -> None:
    rows, accept = tree_samples(decode_tool, pair, method, n, seed=seed)
    assert accept > 1.5, "the trees must accept nodes, or the test only compares plain samples"
    p_values = compare(decode_tool, method, rows, plain, accept)
    assert min(p_values) > P_MIN, p_values


def test_the_drafts_temperature_changes_the_tree_not_the_distribution(
        decode_tool: ModuleType, pair: tuple[Any, Any], plain: list[list[int]]) -> None:
    """A tree built from the draft at the request's temperature (a mistake of public ports) is
    verified by the same rule, so it is still lossless: it only changes which tree is verified and so
    the acceptance, which is why DDTREE.md fixes the tree at T = 1. A rejection rule that reads the
    draft's probabilities is where the draft's temperature would bias the output (below)."""
    target, draft = pair
    at_request_t = (target, lambda tokens, features: draft(tokens, features) / TEMPERATURE)
    rows, accept = tree_samples(decode_tool, at_request_t, "ddtree@16", N_TREE // 2, seed=3)
    p_values = compare(decode_tool, "ddtree@16, draft at the request's T", rows, plain, accept)
    assert min(p_values) > P_MIN, p_values


@pytest.mark.parametrize("draft_temperature", [1.0, TEMPERATURE], ids=["draft-at-T1", "draft-at-request-T"])
def test_a_planted_rejection_rule_fails_the_same_test(decode_tool: ModuleType, pair: tuple[Any, Any],
                                                     plain: list[list[int]], draft_temperature: float) -> None:
    rows, accept = tree_samples(decode_tool, pair, "ddtree@16", N_PLANTED,
                                rejection_walk(decode_tool, draft_temperature), seed=2)
    p_values = compare(decode_tool, f"planted min(1, p/q), draft at T={draft_temperature:g}", rows, plain, accept)
    assert min(p_values) < P_MIN, p_values
