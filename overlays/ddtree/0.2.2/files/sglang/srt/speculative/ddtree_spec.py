"""DDTREE registration: the speculative-algorithm entry, its server-argument rules and verify widths."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Type

from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.speculative.spec_registry import CustomSpecAlgo

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

# The verify-mask buffer of the CUDA graph holds budget * (context + budget) cells
# per request; past this budget it dwarfs the KV cache of small models.
DDTREE_MAX_BUDGET = 1024

# Attention backends whose TARGET_VERIFY honours the tree's custom mask, each shown
# lossless on the H200 (triton: runs 2-8; flashinfer: run 9). SGLang reports DDTREE as
# topk 1, so left alone it would pick fa3 on Hopper, whose topk-1 verify is a causal
# chain: the tree's side branches would attend to the wrong tokens.
DDTREE_VERIFY_BACKENDS = ("triton", "flashinfer")
DDTREE_DEFAULT_BACKEND = "triton"


class DDTreeSpecAlgo(CustomSpecAlgo):
    """DDTREE: one DFlash draft pass, a best-first draft tree, one target verify.

    It is a DFlash-family algorithm for every shared code path (aux hidden capture,
    draft runner in TARGET_VERIFY mode, draft KV sizing), but the target verify is
    a tree of ``1 + budget`` tokens under a custom mask.
    """

    # Read by the decode CUDA-graph runner: capture the target verify with a mask.
    verifies_tree = True

    # Enum methods that CustomSpecAlgo lacks in 0.5.17; their bodies only ask is_*().
    carries_draft_hidden_states = SpeculativeAlgorithm.carries_draft_hidden_states
    need_topk = SpeculativeAlgorithm.need_topk
    create_future_map = SpeculativeAlgorithm.create_future_map

    def is_dflash_family(self) -> bool:
        return True

    def supports_target_verify_for_draft(self) -> bool:
        return True

    def handle_server_args(self, server_args: ServerArgs) -> None:
        handle_ddtree_server_args(server_args)

    def get_num_tokens_per_req_for_target_verify(
        self, num_draft_tokens: int, is_draft_worker: bool
    ) -> int:
        # The draft runs the DFlash block; the target verifies root + budget nodes.
        if is_draft_worker:
            from sglang.srt.runtime_context import get_spec

            return int(get_spec().speculative_dflash_block_size)
        return num_draft_tokens


def _refuse_hybrid_target(server_args: ServerArgs) -> None:
    from sglang.srt.configs.hybrid_arch import mambaish_config

    model_config = server_args.get_model_config()
    if mambaish_config(model_config) is None:
        return
    hf_config = model_config.hf_config
    raise ValueError(
        "DDTREE does not support hybrid linear-attention / recurrent targets: "
        f"model_type={getattr(hf_config, 'model_type', '?')!r}, "
        f"architectures={getattr(hf_config, 'architectures', None)}. A tree verify "
        "would need one recurrent state per tree branch; use --speculative-algorithm "
        "DFLASH for this model."
    )


def _use_a_tree_mask_backend(server_args: ServerArgs) -> None:
    """Default to a backend that takes the tree mask; refuse one asked for that has not been validated.

    The fields themselves still hold what was asked for: SGLang's own default (fa3 on
    Hopper) is only a declaration until the end of ``ServerArgs.__post_init__``, and a
    declaration made here, later, wins over it.
    """
    from sglang.srt.arg_groups.overrides import run_post_process_pass

    asked = {
        name: getattr(server_args, name)
        for name in ("attention_backend", "prefill_attention_backend", "decode_attention_backend")
        if getattr(server_args, name, None) is not None
    }
    unvalidated = {k: v for k, v in asked.items() if v not in DDTREE_VERIFY_BACKENDS}
    if unvalidated:
        flags = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in sorted(unvalidated.items()))
        raise ValueError(
            "DDTREE verifies a draft tree under a custom attention mask and is validated "
            f"with {' or '.join(DDTREE_VERIFY_BACKENDS)} only; got {flags}. Pass "
            f"--attention-backend {DDTREE_DEFAULT_BACKEND} (or leave it unset)."
        )
    if not asked:
        run_post_process_pass(server_args, _ddtree_default_backend)


def _ddtree_default_backend(view) -> dict:
    logger.info(
        "DDTREE: attention backend %s (a tree verify needs a backend that takes its custom mask).",
        DDTREE_DEFAULT_BACKEND,
    )
    return {"attention_backend": DDTREE_DEFAULT_BACKEND}


def handle_ddtree_server_args(server_args: ServerArgs) -> None:
    """Resolve DDTREE arguments in place.

    After this, ``speculative_dflash_block_size`` is the draft block size S (from
    the draft config, as DFLASH infers it) and ``speculative_num_draft_tokens`` is
    the verify width ``1 + budget``.

    Raises:
        ValueError: a hybrid target, an unsupported option, or a budget out of range.
    """
    from sglang.srt.arg_groups.speculative_hook import _handle_dflash

    budget = int(server_args.speculative_ddtree_budget)
    if server_args.speculative_dflash_block_size is not None and (
        server_args.speculative_num_draft_tokens == budget + 1
    ):
        return  # already resolved (the hook may run again on a copy)
    if server_args.speculative_num_draft_tokens is not None:
        raise ValueError(
            "DDTREE sets the verify width from --speculative-ddtree-budget; "
            f"do not pass --speculative-num-draft-tokens (got {server_args.speculative_num_draft_tokens})."
        )
    if server_args.speculative_draft_window_size is not None:
        raise ValueError(
            "DDTREE does not support --speculative-draft-window-size: accepted tree "
            "nodes are committed by permuting the shared request-to-token map."
        )
    if server_args.page_size not in (None, 1):
        raise ValueError(
            f"DDTREE needs --page-size 1 (got {server_args.page_size}): accepted "
            "nodes are scattered inside the verify block and are committed slot by slot."
        )
    if server_args.tp_size != 1:
        raise ValueError(
            f"DDTREE supports --tp-size 1 only (got {server_args.tp_size}): the tree "
            "is built from full-vocabulary draft logits on one device."
        )
    _refuse_hybrid_target(server_args)
    _use_a_tree_mask_backend(server_args)

    # DFLASH rules (device, draft path, steps/topk = 1, draft attention backend);
    # they leave the draft block size in speculative_num_draft_tokens.
    _handle_dflash(server_args)
    block_size = int(server_args.speculative_num_draft_tokens)
    if not block_size - 1 <= budget <= DDTREE_MAX_BUDGET:
        raise ValueError(
            f"--speculative-ddtree-budget must be in [{block_size - 1}, {DDTREE_MAX_BUDGET}], "
            f"got {budget}: the draft block of {block_size} tokens takes its KV slots "
            f"from the {budget + 1} reserved for the tree verify, and above "
            f"{DDTREE_MAX_BUDGET} the verify mask (budget x context per request) "
            "outgrows the CUDA-graph buffer."
        )
    server_args.speculative_dflash_block_size = block_size
    server_args.speculative_num_draft_tokens = budget + 1
    logger.info(
        "DDTREE: draft block size %d, tree budget %d, verify width %d.",
        block_size,
        budget,
        budget + 1,
    )


def _ddtree_worker_factory(server_args: ServerArgs) -> Type:
    from sglang.srt.speculative.ddtree_worker_v2 import DDTreeWorkerV2

    return DDTreeWorkerV2


SpeculativeAlgorithm.register(
    "DDTREE", supports_overlap=True, spec_class=DDTreeSpecAlgo
)(_ddtree_worker_factory)
