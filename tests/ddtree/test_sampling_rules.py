"""Overlay ddtree 0.3.0-rc.2's sampling rules (ddtree_sampling.py): which requests a tree verify
refuses, and the top-k node probabilities the worker samples from, against a transcription of SGLang
0.5.17's ``build_dflash_verify_target_probs`` (dflash_utils.py), bit for bit and in distribution."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

SPEC = "ddtree@0.3.0-rc.2"
SAMPLING = "sglang/srt/speculative/ddtree_sampling.py"
TOP_K_ALL = 1 << 30  # sampling_params.py: top_k unset
NODES = 5  # draft_token_num of the cases: root + 4 nodes
VOCAB = 64


@pytest.fixture(scope="module")
def sampling(decode_tool: ModuleType) -> ModuleType:
    return decode_tool.load_overlay_module(SPEC, SAMPLING)


# --------------------------------------------------------------------------- refusals
def refusal(sampling: ModuleType, **changes: Any) -> str | None:
    params: dict[str, Any] = dict(top_k=TOP_K_ALL, min_p=0.0, frequency_penalty=0.0, presence_penalty=0.0,
                                  repetition_penalty=1.0, min_new_tokens=0, custom_logit_processor=False)
    params.update(changes)
    return sampling.ddtree_request_refusal(**params)


def test_exact_parameters_are_taken(sampling: ModuleType) -> None:
    assert refusal(sampling) is None
    assert refusal(sampling, top_k=20) is None
    assert refusal(sampling, top_k=1, min_p=0.3) is None  # greedy (SGLang sets top_k 1): min_p keeps the argmax


@pytest.mark.parametrize(("changes", "named"), [
    ({"min_p": 0.05}, "min_p=0.05 (a speculative verify does not apply min_p)"),
    ({"frequency_penalty": 0.5}, "frequency_penalty=0.5"),
    ({"presence_penalty": -0.2}, "presence_penalty=-0.2"),
    ({"repetition_penalty": 1.1}, "repetition_penalty=1.1"),
    ({"repetition_penalty": 1.1, "top_k": 1}, "repetition_penalty=1.1"),  # penalties change greedy output too
    ({"min_new_tokens": 4}, "min_new_tokens=4"),
    ({"custom_logit_processor": True}, "custom_logit_processor"),
])
def test_inexact_parameters_are_refused_by_name(sampling: ModuleType, changes: dict[str, Any], named: str) -> None:
    reason = refusal(sampling, **changes)
    assert reason is not None and reason.startswith("DDTREE speculative decoding cannot honour ")
    assert named in reason and reason.endswith("send the request to a server without speculative decoding.")


def test_every_inexact_parameter_is_named_at_once(sampling: ModuleType) -> None:
    reason = refusal(sampling, min_p=0.1, presence_penalty=0.5, min_new_tokens=2)
    assert reason is not None
    assert "min_p=0.1 (" in reason and "presence_penalty=0.5, min_new_tokens=2 (computed from the committed" in reason


def test_the_scheduler_check_reads_the_request(sampling: ModuleType) -> None:
    params = SimpleNamespace(top_k=TOP_K_ALL, min_p=0.0, frequency_penalty=0.0, presence_penalty=0.7,
                             repetition_penalty=1.0, min_new_tokens=0)
    reason = sampling.validate_ddtree_request(SimpleNamespace(sampling_params=params, custom_logit_processor=None))
    assert reason is not None and "presence_penalty=0.7" in reason


# --------------------------------------------------------------------------- top-k node probabilities
def top_p_renorm(probs: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """A torch top-p renormalisation (stand-in for sgl_kernel's: both sides of the comparison use it)."""
    ordered, order = probs.sort(dim=-1, descending=True)
    keep = (ordered.cumsum(-1) - ordered) < top_ps[:, None]
    kept = torch.zeros_like(probs).scatter(-1, order, ordered * keep)
    return kept / kept.sum(-1, keepdim=True)


def top_k_renorm(probs: torch.Tensor, top_ks: torch.Tensor) -> torch.Tensor:
    ranks = probs.argsort(dim=-1, descending=True).argsort(dim=-1)
    kept = probs * (ranks < top_ks[:, None])
    return kept / kept.sum(-1, keepdim=True)


def upstream_target_probs(*, next_token_logits: torch.Tensor, sampling_info: Any, draft_token_num: int, bs: int,
                          max_top_k: int | None = None, uniform_top_k_value: int | None = None,
                          use_sparse_topk: bool = True) -> torch.Tensor:
    """SGLang 0.5.17's build_dflash_verify_target_probs (dflash_utils.py), transcribed line by line."""
    device = next_token_logits.device
    need_top_k = bool(getattr(sampling_info, "need_top_k_sampling", True))
    need_top_p = bool(getattr(sampling_info, "need_top_p_sampling", False))
    expanded_temperature = torch.repeat_interleave(sampling_info.temperatures, draft_token_num, dim=0)
    scaled_logits = next_token_logits / expanded_temperature
    sparse_topk_applied = False
    if use_sparse_topk and need_top_k:
        repeated_top_ks = torch.repeat_interleave(sampling_info.top_ks, draft_token_num, dim=0).to(dtype=torch.int64)
        vocab_size = int(scaled_logits.shape[-1])
        repeated_top_ks.clamp_(min=1, max=vocab_size)
        max_top_k = int(repeated_top_ks.max().item()) if max_top_k is None else int(max_top_k)
        max_top_k = min(max(max_top_k, 1), vocab_size)
        if 0 < max_top_k < vocab_size:
            topk_logits, topk_indices = torch.topk(scaled_logits, k=max_top_k, dim=-1)
            if uniform_top_k_value is None or int(uniform_top_k_value) != max_top_k:
                ranks = torch.arange(max_top_k, device=device, dtype=torch.int64)[None, :]
                valid = ranks < repeated_top_ks.unsqueeze(1)
                topk_logits = topk_logits.masked_fill(~valid, float("-inf"))
            topk_probs = F.softmax(topk_logits, dim=-1)
            if need_top_p:
                repeated_top_ps = torch.repeat_interleave(sampling_info.top_ps, draft_token_num, dim=0)
                topk_probs = top_p_renorm(topk_probs, repeated_top_ps)
            target_probs = torch.zeros_like(scaled_logits, dtype=topk_probs.dtype)
            target_probs.scatter_(1, topk_indices, topk_probs)
            sparse_topk_applied = True
    if not sparse_topk_applied:
        target_probs = F.softmax(scaled_logits, dim=-1)
        if need_top_k:
            target_probs = top_k_renorm(target_probs, torch.repeat_interleave(sampling_info.top_ks, draft_token_num, dim=0))
        if need_top_p:
            target_probs = top_p_renorm(target_probs, torch.repeat_interleave(sampling_info.top_ps, draft_token_num, dim=0))
    return target_probs.view(bs, draft_token_num, -1).contiguous()


def batch_info(top_ks: list[int], top_ps: list[float]) -> SimpleNamespace:
    return SimpleNamespace(temperatures=torch.tensor([[0.7], [1.0], [1.3]][: len(top_ks)]),
                           top_ks=torch.tensor(top_ks), top_ps=torch.tensor(top_ps),
                           need_top_k_sampling=any(k != TOP_K_ALL for k in top_ks),
                           need_top_p_sampling=any(p != 1.0 for p in top_ps))


def sparse_probs(sampling: ModuleType, logits: torch.Tensor, info: SimpleNamespace,
                 uniform: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The worker's sparse path: top-k node probabilities, then the same top-p renormalisation."""
    k = sampling.ddtree_sparse_top_k(need_top_k=info.need_top_k_sampling, max_top_k=int(info.top_ks.max()),
                                     vocab_size=logits.shape[-1])
    probs, tokens = sampling.ddtree_top_k_node_probs(logits=logits, temperatures=info.temperatures,
                                                     top_ks=info.top_ks, draft_token_num=NODES, max_top_k=k,
                                                     uniform_top_k_value=uniform)
    if info.need_top_p_sampling:
        probs = top_p_renorm(probs, torch.repeat_interleave(info.top_ps, NODES, dim=0))
    return probs, tokens


CASES = [  # (top_ks, top_ps, uniform_top_k_value as the draft input computes it)
    ([8, 8, 8], [1.0, 1.0, 1.0], 8),
    ([8, 3, 20], [1.0, 1.0, 1.0], None),
    ([1, 5, 12], [1.0, 0.9, 0.5], None),  # a greedy request (top_k 1) beside sampled ones
    ([16, 16, 16], [0.8, 0.8, 0.95], 16),
]


@pytest.mark.parametrize("family", ["sharp", "flat", "bf16", "integer"])
@pytest.mark.parametrize("case", CASES, ids=["uniform", "mixed-k", "greedy-and-top-p", "uniform-top-p"])
def test_top_k_node_probs_are_sglangs_dense_probs_bit_for_bit(
        sampling: ModuleType, make_logits: Callable[..., torch.Tensor], family: str,
        case: tuple[list[int], list[float], int | None]) -> None:
    top_ks, top_ps, uniform = case
    info = batch_info(top_ks, top_ps)
    logits = make_logits(family, (3 * NODES, VOCAB), 11).float()  # the verify's logits are fp32
    dense = upstream_target_probs(next_token_logits=logits, sampling_info=info, draft_token_num=NODES, bs=3,
                                  max_top_k=max(top_ks), uniform_top_k_value=uniform)
    probs, tokens = sparse_probs(sampling, logits, info, uniform)
    assert tokens.shape == (3 * NODES, max(top_ks))
    scattered = torch.zeros_like(logits).scatter_(1, tokens, probs)
    assert torch.equal(scattered, dense.view(3 * NODES, VOCAB))


def test_the_sparse_path_is_taken_only_below_the_vocabulary(sampling: ModuleType) -> None:
    assert sampling.ddtree_sparse_top_k(need_top_k=True, max_top_k=20, vocab_size=VOCAB) == 20
    assert sampling.ddtree_sparse_top_k(need_top_k=True, max_top_k=0, vocab_size=VOCAB) == 1
    assert sampling.ddtree_sparse_top_k(need_top_k=True, max_top_k=TOP_K_ALL, vocab_size=VOCAB) is None
    assert sampling.ddtree_sparse_top_k(need_top_k=False, max_top_k=20, vocab_size=VOCAB) is None
    with pytest.raises(ValueError, match=r"max_top_k must be in \[1, 64\), got 64"):
        sampling.ddtree_top_k_node_probs(logits=torch.zeros(NODES, VOCAB), temperatures=torch.ones(1, 1),
                                         top_ks=torch.tensor([VOCAB]), draft_token_num=NODES, max_top_k=VOCAB,
                                         uniform_top_k_value=None)


def gumbel_max(probs: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """spec_utils.fast_sample (SGLang 0.5.17): argmax(probs / Exp(1)), one index per row."""
    q = torch.empty_like(probs, dtype=torch.float32).exponential_(1.0, generator=g)
    q.clamp_min_(torch.finfo(torch.float32).tiny)
    return (probs.float() / q).argmax(dim=-1, keepdim=True)


def test_sampling_the_top_k_gives_the_dense_distribution(sampling: ModuleType, decode_tool: ModuleType) -> None:
    """fast_sample over a node's top-k probabilities, mapped through their tokens, against fast_sample
    over SGLang's dense probabilities of the same node (two-sample chi-square, 20000 draws each)."""
    info = batch_info([12, 12, 12], [0.9, 0.9, 0.9])
    logits = torch.randn((3 * NODES, VOCAB), generator=torch.Generator().manual_seed(3)) * 2.0
    dense = upstream_target_probs(next_token_logits=logits, sampling_info=info, draft_token_num=NODES, bs=3,
                                  max_top_k=12, uniform_top_k_value=12).view(3 * NODES, VOCAB)
    probs, tokens = sparse_probs(sampling, logits, info, 12)
    draws = 20_000
    row = 7  # one node of request 1
    g = torch.Generator().manual_seed(4)
    from_top_k = tokens[row].gather(0, gumbel_max(probs[row].expand(draws, -1), g).view(-1))
    from_dense = gumbel_max(dense[row].expand(draws, -1), g).view(-1)
    statistic, df, p_value = decode_tool.chi_square(from_top_k.tolist(), from_dense.tolist())
    print(f"top-k vs dense fast_sample: chi2 {statistic:.2f}, df {df}, p {p_value:.3g}")
    assert p_value > 1e-3
    assert set(from_top_k.tolist()) <= set(dense[row].nonzero().view(-1).tolist())
