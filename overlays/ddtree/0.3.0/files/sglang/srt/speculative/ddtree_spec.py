"""DDTREE registration: the speculative-algorithm entry, its server-argument rules and verify widths."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Tuple, Type

from sglang.srt.speculative.ddtree_hybrid import (
    DDTREE_GDN,
    DDTreeGDNStateSize,
    ddtree_hybrid_target_refusal,
    ddtree_mamba_track_refusal,
    ddtree_memory_refusal,
    ddtree_state_bytes,
)
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.speculative.spec_registry import CustomSpecAlgo

if TYPE_CHECKING:
    from sglang.srt.configs.model_config import ModelConfig
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


def _linear_attention_kind(model_config: ModelConfig) -> Optional[str]:
    """The target's kind of linear-attention layers (None: no such layers)."""
    from sglang.srt.configs.hybrid_arch import (
        hybrid_gdn_config,
        hybrid_lightning_config,
        kimi_linear_config,
        linear_attn_model_spec,
        mamba2_config,
        mambaish_config,
    )

    if mambaish_config(model_config) is None:
        return None
    for kind, config_of in (
        (DDTREE_GDN, hybrid_gdn_config),
        ("mamba2", mamba2_config),
        ("kda", kimi_linear_config),
        ("lightning", hybrid_lightning_config),
    ):
        if config_of(model_config) is not None:
            return kind
    spec = linear_attn_model_spec(model_config)
    return spec.backend_class_name.rsplit(".", 1)[-1] if spec else "linear attention"


def _check_hybrid_target(server_args: ServerArgs) -> Optional[Any]:
    """Refuse a hybrid target or option DDTREE cannot verify a tree on.

    Runs before DFLASH's rules, which would default --max-running-requests.

    Returns:
        The GDN text config of a hybrid target, None for a plain one.
    """
    from sglang.srt.arg_groups.overrides import resolved_view
    from sglang.srt.configs.hybrid_arch import hybrid_gdn_config

    model_config = server_args.get_model_config()
    kind = _linear_attention_kind(model_config)
    view = resolved_view(server_args)
    hf_config = model_config.hf_config
    reason = ddtree_hybrid_target_refusal(
        linear_kind=kind,
        model_type=str(getattr(hf_config, "model_type", "?")),
        architectures=getattr(hf_config, "architectures", None) or [],
        enable_linear_replayssm_spec=bool(view.enable_linear_replayssm_spec),
        enable_linear_replayssm=bool(view.enable_linear_replayssm),
        mamba_radix_cache_strategy=view.mamba_radix_cache_strategy,
        max_running_requests=view.max_running_requests,
    )
    if reason is not None:
        raise ValueError(reason)
    return hybrid_gdn_config(model_config) if kind is not None else None


def _gdn_state_size(text_config: Any) -> DDTreeGDNStateSize:
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(attn_tp_size=1):  # DDTREE runs at --tp-size 1
        params = text_config.mamba2_cache_params
    conv_dim, window = params.shape.conv[0]
    heads, head_v, head_k = params.shape.temporal
    return DDTreeGDNStateSize(
        num_layers=len(params.layers),
        ssm_bytes=heads * head_v * head_k * params.dtype.temporal.itemsize,
        conv_bytes=conv_dim * window * params.dtype.conv.itemsize,
    )


def _state_memory_limit(server_args: ServerArgs) -> Optional[Tuple[int, str]]:
    """The memory the static pool may take, less the checkpoint's weights when the
    model is a local folder (weights, KV cache and recurrent states share it); None
    where the device's memory is unknown."""
    from sglang.srt.arg_groups.overrides import resolved_view
    from sglang.srt.utils.common import get_device_memory_capacity

    gpu_mib = get_device_memory_capacity(server_args.device)
    fraction = resolved_view(server_args).mem_fraction_static
    if gpu_mib is None or fraction is None:
        return None
    gpu_bytes = int(gpu_mib * (1 << 20))
    model_dir = Path(server_args.model_path)
    weights = sum(
        f.stat().st_size
        for pattern in ("*.safetensors", "*.bin")
        for f in (model_dir.glob(pattern) if model_dir.is_dir() else ())
    )
    source = f"--mem-fraction-static {fraction:g} of {gpu_bytes / (1 << 30):.1f} GiB, " + (
        f"less {weights / (1 << 30):.2f} GiB of checkpoint weights"
        if weights
        else "weights not counted"
    )
    return int(gpu_bytes * fraction) - weights, source


def _check_hybrid_state(
    server_args: ServerArgs, text_config: Any, budget: int, block_size: int
) -> None:
    """Refuse a state tracking interval or a memory need a hybrid DDTREE server
    cannot meet, and log what the per-node states take."""
    from sglang.srt.arg_groups.overrides import mamba_extra_buffer_of, resolved_view

    view = resolved_view(server_args)
    reason = ddtree_mamba_track_refusal(
        extra_buffer=mamba_extra_buffer_of(view),
        mamba_track_interval=int(view.mamba_track_interval),
        block_size=block_size,
    )
    size = _gdn_state_size(text_config)
    requests = int(view.max_running_requests)
    limit = _state_memory_limit(server_args)
    if reason is None and limit is not None:
        reason = ddtree_memory_refusal(
            size,
            budget=budget,
            min_budget=block_size - 1,
            max_running_requests=requests,
            limit_bytes=limit[0],
            limit_source=limit[1],
        )
    if reason is not None:
        raise ValueError(reason)
    logger.info(
        "DDTREE on a GatedDeltaNet hybrid: %d GDN layers, %.2f MiB of recurrent state "
        "per tree node and request, %.2f GiB for budget %d and %d running requests.",
        size.num_layers,
        size.node_bytes / (1 << 20),
        ddtree_state_bytes(size, budget=budget, max_running_requests=requests) / (1 << 30),
        budget,
        requests,
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
        ValueError: a hybrid target other than GatedDeltaNet, an unsupported option,
            a budget out of range, or per-node recurrent states that cannot fit.
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
    gdn_config = _check_hybrid_target(server_args)
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
    if gdn_config is not None:
        _check_hybrid_state(server_args, gdn_config, budget, block_size)
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
