"""DDTREE sampling (T > 0): which request parameters a tree verify honours exactly, and the target's top-k probabilities per node.

At T > 0 the target's pick at every tree node is an independent sample from its distribution there
(temperature, top-k, top-p), and the walk follows the child holding it (DDTREE.md): every committed
token is then a sample of the target's own distribution given the tokens before it. A parameter that
depends on those tokens (penalties, min_new_tokens, a custom logit processor) is computed from the
committed tokens only and applied alike to every node, although a node at depth d follows d more
tokens; min_p is not applied by SGLang's speculative verify at all. Requests that set them are
refused (``validate_ddtree_request``), never silently approximated.

Torch only (no sglang imports), so it is tested on the CPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional, Tuple

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req

__all__ = [
    "ddtree_request_refusal",
    "ddtree_sparse_top_k",
    "ddtree_top_k_node_probs",
    "validate_ddtree_request",
]


def ddtree_request_refusal(
    *,
    top_k: int,
    min_p: float,
    frequency_penalty: float,
    presence_penalty: float,
    repetition_penalty: float,
    min_new_tokens: int,
    custom_logit_processor: bool,
) -> Optional[str]:
    """Why a DDTREE verify cannot honour a request's sampling parameters exactly, or None.

    The defaults (min_p 0, penalties 0 / 0 / 1, min_new_tokens 0, no processor) are honoured.
    Penalties change greedy requests too; min_p does not (SGLang makes a greedy request top_k 1,
    and min_p always keeps the top token). Temperature, top_k, top_p, logit_bias and stop conditions
    are exact (per node, or independent of the tokens before it).
    """
    inexact: List[str] = []
    if min_p > 0.0 and top_k != 1:
        inexact.append(f"min_p={min_p:g} (a speculative verify does not apply min_p)")
    history = [
        (f"frequency_penalty={frequency_penalty:g}", frequency_penalty != 0.0),
        (f"presence_penalty={presence_penalty:g}", presence_penalty != 0.0),
        (f"repetition_penalty={repetition_penalty:g}", repetition_penalty != 1.0),
        (f"min_new_tokens={min_new_tokens}", min_new_tokens > 0),
        ("custom_logit_processor", custom_logit_processor),
    ]
    depends = [name for name, is_set in history if is_set]
    if depends:
        inexact.append(
            ", ".join(depends) + " (computed from the committed tokens and applied alike to every "
            "tree node, though a node at depth d follows d more tokens)"
        )
    if not inexact:
        return None
    return (
        "DDTREE speculative decoding cannot honour " + "; ".join(inexact) + " exactly. "
        "Drop these sampling parameters, or send the request to a server without speculative decoding."
    )


def validate_ddtree_request(req: Req) -> Optional[str]:
    """The scheduler's per-request check (beside ``validate_dflash_request``): a reason to abort, or None."""
    params = req.sampling_params
    return ddtree_request_refusal(
        top_k=int(params.top_k),
        min_p=float(params.min_p),
        frequency_penalty=float(params.frequency_penalty),
        presence_penalty=float(params.presence_penalty),
        repetition_penalty=float(params.repetition_penalty),
        min_new_tokens=int(params.min_new_tokens),
        custom_logit_processor=bool(req.custom_logit_processor),
    )


def ddtree_sparse_top_k(*, need_top_k: bool, max_top_k: int, vocab_size: int) -> Optional[int]:
    """The k of the top-k probabilities to sample from, or None where every token can be drawn.

    The same rule as ``build_dflash_verify_target_probs``' sparse path: some request sets a top_k
    and the largest one (clamped to [1, V]) is below the vocabulary.
    """
    if not need_top_k:
        return None
    k = min(max(int(max_top_k), 1), int(vocab_size))
    return k if k < vocab_size else None


def ddtree_top_k_node_probs(
    *,
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ks: torch.Tensor,
    draft_token_num: int,
    max_top_k: int,
    uniform_top_k_value: Optional[int],
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The target's top-k probabilities at every node and their tokens, before top-p.

    The computation of ``build_dflash_verify_target_probs``' sparse path (SGLang 0.5.17,
    dflash_utils.py) up to its scatter into a dense ``[N, V]`` tensor: scattering ``probs`` at
    ``tokens`` (after the same top-p renormalisation) gives that tensor bit for bit, and a sample of
    ``probs`` mapped through ``tokens`` has its distribution, without the dense probabilities and
    noise per node.

    Args:
        logits: The target's logits at every node. Shape: [bs * draft_token_num, V].
        temperatures: Per request, > 0. Shape: [bs, 1] (``SamplingBatchInfo.temperatures``).
        top_ks: Per request. Shape: [bs].
        draft_token_num: Nodes per request (root included).
        max_top_k: k, from ``ddtree_sparse_top_k``: 1 <= k < V.
        uniform_top_k_value: Every request's top_k when they agree, else None.

    Returns:
        (probs, tokens), each [bs * draft_token_num, k]: softmax over each node's top k of
        logits / T, ranks past the request's own top_k at probability 0.
    """
    vocab_size = int(logits.shape[-1])
    if not 1 <= max_top_k < vocab_size:
        raise ValueError(f"max_top_k must be in [1, {vocab_size}), got {max_top_k}.")
    scaled_logits = logits / torch.repeat_interleave(temperatures, draft_token_num, dim=0)
    repeated_top_ks = torch.repeat_interleave(top_ks, draft_token_num, dim=0).to(dtype=torch.int64)
    repeated_top_ks.clamp_(min=1, max=vocab_size)
    topk_logits, topk_indices = torch.topk(scaled_logits, k=max_top_k, dim=-1)
    if uniform_top_k_value is None or int(uniform_top_k_value) != max_top_k:
        ranks = torch.arange(max_top_k, device=logits.device, dtype=torch.int64)[None, :]
        topk_logits = topk_logits.masked_fill(~(ranks < repeated_top_ks.unsqueeze(1)), float("-inf"))
    return F.softmax(topk_logits, dim=-1), topk_indices
