"""Overlay ddtree 0.3.0-rc.6: top-k and top-p are cut together as plain decoding cuts them.

The oracle is SGLang 0.5.17's own plain sampler (sampler.py's
``top_k_top_p_min_p_sampling_from_probs_torch``, lifted from the release file and run with a
``torch.multinomial`` that records the masked probabilities it is asked to sample from). The node
probabilities rc.6's worker samples from must be that distribution at every node; SGLang's DFLASH
verify rule, which rc.2..rc.5 follow bit for bit (test_sampling_rules.py), must not be whenever
both cuts bite: that is the control.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

from tests.ddtree.test_sampling_lossless import (
    N_PLAIN,
    N_PLANTED,
    N_TREE,
    P_MIN,
    POSITIONS,
    PROMPT,
    TEMPERATURE,
    compare,
    markov_pair,
    tree_samples,
)
from tests.ddtree.test_sampling_rules import NODES, TOP_K_ALL, VOCAB, batch_info, sparse_probs, top_p_renorm

RC6 = "ddtree@0.3.0-rc.6"
SAMPLING = "sglang/srt/speculative/ddtree_sampling.py"


@pytest.fixture(scope="module")
def rc6(decode_tool: ModuleType) -> ModuleType:
    return decode_tool.load_overlay_module(RC6, SAMPLING)


def rc6_node_distribution(rc6: ModuleType, logits: torch.Tensor, info: SimpleNamespace,
                          uniform: int | None) -> torch.Tensor:
    """What rc.6's worker samples from at each node (its _sample_picks, both cuts set)."""
    k = rc6.ddtree_sparse_top_k(need_top_k=True, max_top_k=int(info.top_ks.max()), vocab_size=VOCAB) or VOCAB
    probs, tokens = rc6.ddtree_top_k_node_probs(
        logits=logits, temperatures=info.temperatures, top_ks=info.top_ks, draft_token_num=NODES,
        max_top_k=k, uniform_top_k_value=uniform, top_ps=info.top_ps)
    return torch.zeros_like(logits).scatter(1, tokens, probs)


def repeated(info: SimpleNamespace, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain decoding's inputs for the same nodes: probabilities at each request's temperature."""
    temps = torch.repeat_interleave(info.temperatures, NODES, dim=0)
    top_ks = torch.repeat_interleave(info.top_ks, NODES, dim=0).clamp(max=VOCAB)
    return torch.softmax(logits / temps, dim=-1), top_ks, torch.repeat_interleave(info.top_ps, NODES, dim=0)


CASES = [  # (top_ks, top_ps, uniform_top_k_value as the draft input computes it)
    ([20, 20, 20], [0.95, 0.95, 0.95], 20),  # Qwen's recommended sampling
    ([8, 3, 20], [0.5, 0.9, 0.8], None),
    ([1, 5, 12], [1.0, 0.9, 0.5], None),  # a greedy request beside sampled ones
    ([TOP_K_ALL, 6, 30], [0.7, 0.9, 1.0], None),  # one request without top_k: the whole vocabulary
]


@pytest.mark.parametrize("family", ["sharp", "flat", "bf16", "integer"])
@pytest.mark.parametrize("case", CASES, ids=["qwen", "mixed", "greedy-beside", "one-unset"])
def test_every_node_samples_from_plain_decodings_distribution(
        rc6: ModuleType, plain_distribution: Callable[..., torch.Tensor], make_logits: Callable[..., torch.Tensor],
        family: str, case: tuple[list[int], list[float], int | None]) -> None:
    top_ks, top_ps, uniform = case
    info = batch_info(top_ks, top_ps)
    logits = make_logits(family, (3 * NODES, VOCAB), 23).float()
    want, got = plain_distribution(*repeated(info, logits)), rc6_node_distribution(rc6, logits, info, uniform)
    if family == "integer":  # exact ties across a cut: which tied token is kept is the sort's choice, either way
        want, got = want.sort(dim=-1)[0], got.sort(dim=-1)[0]
    assert torch.allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("family", ["flat", "bf16"])
@pytest.mark.parametrize("case", CASES[:2], ids=["qwen", "mixed"])
def test_the_control_rc5s_rule_which_is_dflashs_parts_from_plain_sampling(
        decode_tool: ModuleType, plain_distribution: Callable[..., torch.Tensor],
        make_logits: Callable[..., torch.Tensor], family: str, case: tuple[list[int], list[float], int | None]) -> None:
    top_ks, top_ps, uniform = case
    info = batch_info(top_ks, top_ps)
    logits = make_logits(family, (3 * NODES, VOCAB), 23).float()
    probs, tokens = sparse_probs(decode_tool.load_overlay_module("ddtree@0.3.0-rc.5", SAMPLING), logits, info, uniform)
    gap = (torch.zeros_like(logits).scatter(1, tokens, probs) - plain_distribution(*repeated(info, logits))).abs()
    assert gap.max() > 0.02  # 0.02-0.30 of probability moved, on these logits


def test_dflashs_rule_keeps_fewer_tokens_than_plain_sampling(
        rc6: ModuleType, decode_tool: ModuleType, plain_distribution: Callable[..., torch.Tensor]) -> None:
    """Probabilities (0.4, 0.3, 0.3), top_k 2, top_p 0.5: plain samples 4:3 from the first two;
    DFLASH's verify renormalises over the two (0.57, 0.43) and then cuts at 0.5, keeping one."""
    rc5 = decode_tool.load_overlay_module("ddtree@0.3.0-rc.5", SAMPLING)
    probs = torch.full((VOCAB,), 1e-9)
    probs[:3] = torch.tensor([0.4, 0.3, 0.3])
    logits = probs.log().repeat(NODES, 1)
    info = SimpleNamespace(temperatures=torch.ones(1, 1), top_ks=torch.tensor([2]), top_ps=torch.tensor([0.5]),
                           need_top_k_sampling=True, need_top_p_sampling=True)
    plain = plain_distribution(torch.softmax(logits, -1), torch.full((NODES,), 2), torch.full((NODES,), 0.5))
    assert torch.allclose(plain[0, :2], torch.tensor([4 / 7, 3 / 7]), atol=1e-5)
    assert torch.allclose(rc6_node_distribution(rc6, logits, info, 2), plain, atol=1e-6)
    dflash_probs, dflash_tokens = sparse_probs(rc5, logits, info, 2)
    assert torch.equal(dflash_tokens[0], torch.tensor([0, 1])) and dflash_probs[0].tolist() == [1.0, 0.0]


def test_without_top_p_the_node_probs_are_rc5s_bit_for_bit(rc6: ModuleType, decode_tool: ModuleType,
                                                           make_logits: Callable[..., torch.Tensor]) -> None:
    rc5 = decode_tool.load_overlay_module("ddtree@0.3.0-rc.5", SAMPLING)
    info = batch_info([8, 3, 20], [1.0, 1.0, 1.0])
    logits = make_logits("bf16", (3 * NODES, VOCAB), 5).float()
    assert all(torch.equal(a, b) for a, b in zip(sparse_probs(rc6, logits, info, None),
                                                 sparse_probs(rc5, logits, info, None), strict=True))


# --------------------------------------------------------------------------- end to end, chi-square
TOP_K, TOP_P = 2, 0.5  # on the Markov pair plain keeps two successors (about 0.62 : 0.38), DFLASH's rule one


def sampler_for(tool: ModuleType, distribution: Callable[[torch.Tensor], torch.Tensor]
                ) -> Callable[[torch.Generator], Any]:
    """Samplers at TEMPERATURE whose every row (position or tree node) is drawn from `distribution`."""

    @dataclasses.dataclass
    class Cut(tool.Sampler):
        def probs(self, logits: torch.Tensor) -> torch.Tensor:
            return distribution(logits.float()).double()

    return lambda generator: Cut(TEMPERATURE, generator)


def node_rule(module: ModuleType, joint: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """An overlay version's node distribution for one request of TOP_K and TOP_P: joint (rc.6) or
    top-p after the top-k renormalisation (rc.5, DFLASH's verify)."""

    def distribution(logits: torch.Tensor) -> torch.Tensor:
        rows = logits.shape[0]
        probs, tokens = module.ddtree_top_k_node_probs(
            logits=logits, temperatures=torch.tensor([[TEMPERATURE]]), top_ks=torch.tensor([TOP_K]),
            draft_token_num=rows, max_top_k=TOP_K, uniform_top_k_value=TOP_K,
            **({"top_ps": torch.tensor([TOP_P])} if joint else {}))
        if not joint:
            probs = top_p_renorm(probs, torch.full((rows,), TOP_P))
        return torch.zeros_like(logits).scatter(1, tokens, probs)

    return distribution


@pytest.fixture(scope="module")
def joint_plain(decode_tool: ModuleType, plain_distribution: Callable[..., torch.Tensor]
                ) -> tuple[tuple[Any, Any], list[list[int]]]:
    pair = markov_pair(decode_tool)
    plain = sampler_for(decode_tool, lambda logits: plain_distribution(
        torch.softmax(logits / TEMPERATURE, -1), torch.full((len(logits),), TOP_K), torch.full((len(logits),), TOP_P)))
    return pair, decode_tool.sample_generate(pair[0], PROMPT, POSITIONS, plain(torch.Generator().manual_seed(0)),
                                             rows=N_PLAIN)


@pytest.mark.parametrize(("spec", "joint", "n", "lossless"), [("ddtree@0.3.0-rc.6", True, N_TREE, True),
                                                               ("ddtree@0.3.0-rc.5", False, N_PLANTED, False)],
                         ids=["rc6-joint", "rc5-control"])
def test_with_both_cuts_only_the_joint_rule_samples_as_plain_decoding(
        decode_tool: ModuleType, joint_plain: tuple[tuple[Any, Any], list[list[int]]], spec: str, joint: bool,
        n: int, lossless: bool) -> None:
    pair, plain = joint_plain
    rule = node_rule(decode_tool.load_overlay_module(spec, SAMPLING), joint)
    rows, accept = tree_samples(decode_tool, pair, "ddtree@16", n, seed=7, sampler_for=sampler_for(decode_tool, rule))
    assert accept > 1.5, "the trees must accept nodes, or the test only compares plain samples"
    p_values = compare(decode_tool, f"{spec}, top_k {TOP_K}, top_p {TOP_P}", rows, plain, accept)
    for position, p_value in enumerate(p_values):
        if math.isnan(p_value):  # one token only at this position, in both samples: no degree of freedom
            assert {r[position] for r in rows} == {r[position] for r in plain}
    assert (min(p for p in p_values if not math.isnan(p)) > P_MIN) == lossless, p_values
