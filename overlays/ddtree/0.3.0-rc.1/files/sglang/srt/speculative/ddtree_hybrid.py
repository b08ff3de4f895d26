"""DDTREE on hybrid GatedDeltaNet targets: which targets and options it takes, the memory
its per-node recurrent states need, and the debug check of the committed states.

A tree verify on a GDN layer keeps one conv window and one SSM state per tree node
(``intermediate_conv_window`` / ``intermediate_ssm`` of the mamba pool, ``budget + 1``
steps per running request) and, after the walk, copies those of the last accepted node
into the request's committed state. This module is torch only (no sglang imports) so
its rules and checks run on the CPU; ``ddtree_spec`` and the worker feed it SGLang's
configuration and pool tensors.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

# Linear-attention layer kinds, as ``ddtree_spec`` classifies a target with SGLang's
# hybrid_arch helpers. Only GDN has a validated tree verify (conv + recurrence kernels
# that follow parents, a node-indexed commit).
DDTREE_GDN = "gdn"
DDTREE_LINEAR_KIND_NAMES = {
    DDTREE_GDN: "GatedDeltaNet",
    "mamba2": "Mamba2",
    "kda": "KDA (Kimi linear attention)",
    "lightning": "lightning attention",
}

# The committed conv window is a copy of the bf16 inputs, so it must match the chain
# exactly; the SSM state is an fp32 recurrence whose inputs (the conv outputs, rounded
# to the activation dtype) may differ from the oracle's by one rounding: its error is
# judged relative to the state's magnitude.
DDTREE_SSM_STATE_RTOL = 1e-2


# --------------------------------------------------------------------------- refusal rules
def ddtree_hybrid_target_refusal(
    *,
    linear_kind: Optional[str],
    model_type: str,
    architectures: Sequence[str],
    enable_linear_replayssm_spec: bool,
    enable_linear_replayssm: bool,
    mamba_radix_cache_strategy: Optional[str],
    max_running_requests: Optional[int],
) -> Optional[str]:
    """Why DDTREE refuses this target and these options, or None (start-up rule).

    Args:
        linear_kind: None for a target without linear-attention layers, else
            ``DDTREE_GDN``, ``"mamba2"``, ``"kda"``, ``"lightning"`` or the name of
            another registered linear-attention backend.
        max_running_requests: As asked for (before DFLASH's rules default it).
    """
    if linear_kind is None:
        return None
    target = f"model_type={model_type!r}, architectures={list(architectures)}"
    if linear_kind != DDTREE_GDN:
        kind = DDTREE_LINEAR_KIND_NAMES.get(linear_kind, linear_kind)
        return (
            f"DDTREE supports hybrid targets with GatedDeltaNet layers only; this target "
            f"({target}) has {kind} layers, whose tree verify is not validated. Use "
            "--speculative-algorithm DFLASH for this model."
        )
    if enable_linear_replayssm_spec:
        return (
            "DDTREE does not support --enable-linear-replayssm-spec: its ring verify "
            "assumes a linear draft chain, and a DDTREE verify is a tree. Drop the flag."
        )
    if enable_linear_replayssm:
        return (
            "DDTREE does not support --enable-linear-replayssm: the decode ring is not "
            "validated with a tree verify. Drop the flag."
        )
    if mamba_radix_cache_strategy == "extra_buffer_lazy":
        return (
            "DDTREE does not support --mamba-radix-cache-strategy extra_buffer_lazy "
            "(its track plan is DFLASH's chain); use extra_buffer or no_buffer."
        )
    if max_running_requests is None:
        return (
            f"DDTREE on a hybrid target ({target}) needs --max-running-requests: every "
            "running request keeps budget + 1 recurrent-state snapshots per GDN layer, "
            "so the request count sets the memory (DFLASH's rules would default it to 48)."
        )
    return None


def ddtree_mamba_track_refusal(
    *, extra_buffer: bool, mamba_track_interval: int, block_size: int
) -> Optional[str]:
    """Why the radix-cache state tracking cannot serve DDTREE, or None.

    A round commits at most ``block_size`` tokens, so an interval of at least that many
    tokens is crossed at most once per round, which is all the commit can track.
    """
    if extra_buffer and mamba_track_interval < block_size:
        return (
            f"--mamba-track-interval {mamba_track_interval} is below the DDTREE draft "
            f"block size {block_size}: a round commits up to {block_size} tokens and "
            f"tracks one interval crossing. Pass --mamba-track-interval >= {block_size}."
        )
    return None


# --------------------------------------------------------------------------- memory
@dataclasses.dataclass(frozen=True)
class DDTreeGDNStateSize:
    """Bytes of one request's recurrent state at one tree node (SGLang's
    ``mamba2_cache_params`` at tensor parallel size 1)."""

    num_layers: int
    # One layer's SSM state: value heads x head_v x head_k x itemsize.
    ssm_bytes: int
    # One layer's conv window: (2 key dims + value dim) x (kernel - 1) x itemsize.
    conv_bytes: int

    @property
    def node_bytes(self) -> int:
        return self.num_layers * (self.ssm_bytes + self.conv_bytes)


def ddtree_state_bytes(
    size: DDTreeGDNStateSize, *, budget: int, max_running_requests: int
) -> int:
    """Recurrent state a DDTREE server holds: per request (and the pool's padding row)
    one snapshot per verify node (``budget + 1``) plus the committed state."""
    return (max_running_requests + 1) * (budget + 2) * size.node_bytes


def ddtree_largest_budget(
    size: DDTreeGDNStateSize, *, max_running_requests: int, limit_bytes: int
) -> int:
    """The largest budget whose state fits in ``limit_bytes`` (may be negative)."""
    return limit_bytes // ((max_running_requests + 1) * size.node_bytes) - 2


def ddtree_memory_refusal(
    size: DDTreeGDNStateSize,
    *,
    budget: int,
    min_budget: int,
    max_running_requests: int,
    limit_bytes: int,
    limit_source: str,
) -> Optional[str]:
    """Why the per-node states of this budget and request count cannot fit, or None.

    Args:
        min_budget: The smallest budget DDTREE takes (block size - 1).
        limit_bytes: The memory the states may take at most.
        limit_source: How ``limit_bytes`` was found (for the message).
    """
    need = ddtree_state_bytes(size, budget=budget, max_running_requests=max_running_requests)
    if need <= limit_bytes:
        return None
    largest = ddtree_largest_budget(
        size, max_running_requests=max_running_requests, limit_bytes=limit_bytes
    )
    mib, gib = 1 << 20, 1 << 30
    fits = (
        f"the largest budget that fits is {largest}"
        if largest >= min_budget
        else (
            f"no budget >= {min_budget} fits; at budget {min_budget} at most "
            f"{max(limit_bytes // ((min_budget + 2) * size.node_bytes) - 1, 0)} running "
            "requests fit"
        )
    )
    return (
        f"DDTREE --speculative-ddtree-budget {budget} with --max-running-requests "
        f"{max_running_requests} needs {need / gib:.2f} GiB of recurrent state "
        f"({size.node_bytes / mib:.2f} MiB per tree node and request: {size.num_layers} "
        f"GDN layers x ({size.ssm_bytes / mib:.3f} MiB SSM + {size.conv_bytes / mib:.3f} "
        f"MiB conv), x {budget + 2} nodes x {max_running_requests + 1} requests), more "
        f"than the {limit_bytes / gib:.2f} GiB available ({limit_source}); {fits}."
    )


# --------------------------------------------------------------------------- debug checks
def ddtree_link_parents(parents: torch.Tensor) -> torch.Tensor:
    """The parents the conv kernel derives from ``ddtree_tree_links``: the tree's, with
    the root and padding nodes (never linked) resolving to the root, 0.

    Shape: [bs, budget + 1] in and out.
    """
    return parents.clamp(min=0)


def ddtree_gdn_chain_state(
    *,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: Optional[torch.Tensor],
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    num_k_heads: int,
    head_k_dim: int,
    head_v_dim: int,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """A GDN layer's state after a chain of tokens (fp32 oracle of SGLang's kernels).

    Args:
        conv_state: The committed conv window before the chain. Shape: [dim, K - 1].
        ssm_state: The committed SSM state before it. Shape: [HV, V, K_head].
        x: The layer's pre-conv inputs (``mixed_qkv``) of the chain. Shape: [T, dim].
        a, b: The gate inputs of the chain. Shape: [T, HV].
        conv_weight: Shape: [dim, K]; conv_bias: [dim] or None.
        A_log, dt_bias: Shape: [HV].

    Returns:
        (conv_state, ssm_state) after the chain: the last K - 1 inputs (conv_state's
        dtype) and the fp32 state of the gated delta rule (SiLU conv, L2-normalised
        k, g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)).
    """
    width = conv_weight.shape[1]
    inputs = torch.cat([conv_state.t(), x.to(conv_state.dtype)], dim=0)
    windows = inputs.float().unfold(0, width, 1)  # [T, dim, K], oldest first
    out = (windows * conv_weight.float()).sum(dim=-1)
    if conv_bias is not None:
        out = out + conv_bias.float()
    out = F.silu(out).to(x.dtype).float()  # the kernel stores its output in x's dtype
    key_dim = num_k_heads * head_k_dim
    num_v_heads = ssm_state.shape[0]
    # q only shapes the output: the state needs k and v.
    k = _l2norm(out[:, key_dim : 2 * key_dim].view(-1, num_k_heads, head_k_dim))
    k = k.repeat_interleave(num_v_heads // num_k_heads, dim=1)  # value head -> its key head
    v = out[:, 2 * key_dim :].view(-1, num_v_heads, head_v_dim)
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float(), threshold=20.0)
    beta = torch.sigmoid(b.float())
    h = ssm_state.float().clone()  # [HV, V, K]
    for t in range(x.shape[0]):
        h = h * g[t].exp()[:, None, None]
        delta = (v[t] - (h * k[t][:, None, :]).sum(dim=-1)) * beta[t][:, None]
        h = h + delta[:, :, None] * k[t][:, None, :]
    return inputs[-(width - 1) :].t().contiguous(), h


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    # As the kernel: x / sqrt(sum(x^2) + 1e-6).
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


@dataclasses.dataclass
class DDTreeLayerInputs:
    """What a GDN layer's verify forward took (recorded in eager rounds only)."""

    layer: object  # sglang RadixLinearAttention
    mixed_qkv: torch.Tensor  # [bs * width, dim]
    a: torch.Tensor  # [bs * width, HV]
    b: torch.Tensor  # [bs * width, HV]


class DDTreeStateCheck:
    """``--speculative-ddtree-debug`` on a GDN hybrid: after each round's commit, compare
    every request's committed conv and SSM states with an fp32 chain pass over its
    accepted tokens, started from the state the round began with.

    The layer inputs are recorded by wrapping the linear-attention backend's
    ``forward_extend``, so only eager verifies are checked (a CUDA-graph replay runs no
    Python); a round without records reports ``checked: false``.
    """

    def __init__(self, layer_cache: Callable[[int], Tuple[torch.Tensor, torch.Tensor]],
                 layer_ids: Sequence[int]):
        # layer_id -> (conv pool [rows, dim, K-1], ssm pool [rows, HV, V, K]).
        self.layer_cache = layer_cache
        self.layer_ids = list(layer_ids)
        self._inputs: Dict[int, DDTreeLayerInputs] = {}
        self._before: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
        self._slots: Optional[torch.Tensor] = None

    def install(self, linear_backend: object) -> None:
        """Record the inputs of every TARGET_VERIFY forward of ``linear_backend``."""
        forward_extend = linear_backend.forward_extend  # type: ignore[attr-defined]

        def recording_forward_extend(layer, forward_batch, mixed_qkv, a, b, **kwargs):
            if forward_batch.forward_mode.is_target_verify():
                self._inputs[layer.layer_id] = DDTreeLayerInputs(
                    layer=layer, mixed_qkv=mixed_qkv.clone(), a=a.clone(), b=b.clone()
                )
            return forward_extend(layer, forward_batch, mixed_qkv, a, b, **kwargs)

        linear_backend.forward_extend = recording_forward_extend  # type: ignore[attr-defined]

    def before_verify(self, slots: torch.Tensor) -> None:
        """Keep the committed states of the batch's mamba slots before the verify."""
        self._inputs.clear()
        self._slots = slots.to(torch.int64)
        self._before = {
            layer_id: (conv[self._slots].clone(), ssm[self._slots].clone())
            for layer_id, (conv, ssm) in ((i, self.layer_cache(i)) for i in self.layer_ids)
        }

    def after_commit(self, path: torch.Tensor, accept_lens: torch.Tensor,
                     width: int) -> List[Dict[str, object]]:
        """One result per request: ``checked``, ``conv_exact``, ``conv_max_abs``,
        ``ssm_max_abs``, ``ssm_scale`` (max |state|) and ``ok``.

        Args:
            path: Node indices of each accepted path from the root. Shape: [bs, S].
            accept_lens: 1 + accepted nodes. Shape: [bs].
            width: Verify tokens per request (budget + 1).
        """
        assert self._slots is not None, "before_verify must run first"
        bs = int(path.shape[0])
        if set(self._inputs) != set(self.layer_ids):
            return [{"checked": False} for _ in range(bs)]
        lens = accept_lens.tolist()
        results = []
        for row in range(bs):
            nodes = path[row, : lens[row]].to(torch.int64) + row * width
            results.append(self._check_request(row, nodes))
        return results

    def _check_request(self, row: int, nodes: torch.Tensor) -> Dict[str, object]:
        slot = self._slots[row]
        conv_err = ssm_err = ssm_scale = 0.0
        for layer_id in self.layer_ids:
            seen = self._inputs[layer_id]
            layer = seen.layer
            conv_before, ssm_before = self._before[layer_id]
            want_conv, want_ssm = ddtree_gdn_chain_state(
                conv_state=conv_before[row],
                ssm_state=ssm_before[row],
                x=seen.mixed_qkv[nodes],
                a=seen.a[nodes],
                b=seen.b[nodes],
                conv_weight=layer.conv_weights,
                conv_bias=layer.bias,
                A_log=layer.A_log,
                dt_bias=layer.dt_bias,
                num_k_heads=layer.num_k_heads,
                head_k_dim=layer.head_k_dim,
                head_v_dim=layer.head_v_dim,
            )
            conv, ssm = self.layer_cache(layer_id)
            conv_err = max(conv_err, (conv[slot].float() - want_conv.float()).abs().max().item())
            ssm_err = max(ssm_err, (ssm[slot].float() - want_ssm).abs().max().item())
            ssm_scale = max(ssm_scale, want_ssm.abs().max().item())
        ok = conv_err == 0.0 and ssm_err <= DDTREE_SSM_STATE_RTOL * max(ssm_scale, 1.0)
        return {"checked": True, "conv_exact": conv_err == 0.0, "conv_max_abs": conv_err,
                "ssm_max_abs": ssm_err, "ssm_scale": ssm_scale, "ok": ok}
