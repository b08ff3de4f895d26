"""The causal conv1d of a GatedDeltaNet layer's tree verify, with every node of a tree at once.

SGLang's tree mode of ``causal_conv1d_update`` (``causal_conv1d_triton.py``) derives the parents
from ``retrieve_next_token`` / ``retrieve_next_sibling`` one node after another and then walks each
node's ancestors with loads that wait on each other, one node after another, in one program per
256 channels. A DDTree verify at budget 64 has 65 nodes, so that walk is 65 dependent steps where
DFLASH's chain of 16 takes 16 independent ones (run 23: 66 us a launch on the copy hybrid, 13x the
chain's, the largest kernel of a DDTREE@64 round). Here the nodes are the rows of one tile: the
links are inverted by comparison, sibling chains are followed by pointer doubling, and the
ancestor windows are gathered, so no step waits on another node.

Outputs, per-node windows (``intermediate_conv_window``), the derived parents
(``retrieve_parent_token``, which the GDN tree recurrence reads next) and the rolled conv state are
SGLang's bit for bit: each node accumulates the same products in the same order. Parents follow
SGLang's rule for the links DDTree builds (every link points to a later node): ``parent[next[t]] =
t``, ``parent[sib[t]] = parent[t]``, the root and unlinked (padding) nodes under the root.
"""

from typing import Optional, Union

import torch
import triton
import triton.language as tl

from sglang.kernels.ops.mamba.causal_conv1d_triton import PAD_SLOT_ID, causal_conv1d_update

# Where run 24 measured this kernel faster than SGLang's (bench/conv1d_tree_verify.py, H200, bf16):
# 65 nodes (budget 64), 3.4x on the copy hybrid (16 channel programs a request) and 1.2x for one
# Qwen3.6-27B request (320), but 0.5x for four 27B requests (1,280 programs: each derives the
# parents again) and 0.7x at 17 nodes, where SGLang's walk is short. Its cost is set by the tile,
# a power of two, so 65-128 nodes cost what 65 do, while SGLang's walk grows with every node.
MIN_TREE_NODES, MAX_TREE_NODES, MAX_PROGRAMS = 65, 128, 320


@triton.jit
def _links_inverted(links_ptr, stride_token, seqlen, idx, NP2_SEQLEN: tl.constexpr, CHUNK: tl.constexpr):
    """For each node u, the latest node t whose link points to u (-1: none)."""
    source = tl.full((NP2_SEQLEN,), -1, tl.int32)
    for start in tl.static_range(0, NP2_SEQLEN, CHUNK):
        t = start + tl.arange(0, CHUNK)
        target = tl.load(links_ptr + t * stride_token, mask=t < seqlen, other=-1)
        hit = target[None, :] == idx[:, None]
        source = tl.maximum(source, tl.max(tl.where(hit, t[None, :], -1), axis=1))
    return source


@triton.jit
def _tree_parents(next_ptr, sib_ptr, stride_next, stride_sib, seqlen, idx, NP2_SEQLEN: tl.constexpr,
                  LOG2_SEQLEN: tl.constexpr, CHUNK: tl.constexpr):
    """SGLang's parents of the links, all nodes at once: a first child's parent is the node that
    names it; a later sibling has its previous sibling's parent, found by doubling along the chain
    (the later of the two links wins, as the serial rule's later write does)."""
    first_child_of = _links_inverted(next_ptr, stride_next, seqlen, idx, NP2_SEQLEN, CHUNK)
    next_sibling_of = _links_inverted(sib_ptr, stride_sib, seqlen, idx, NP2_SEQLEN, CHUNK)
    is_sibling = next_sibling_of > first_child_of
    chain_head = tl.where(is_sibling, next_sibling_of, idx)
    for _ in tl.static_range(LOG2_SEQLEN):
        chain_head = tl.gather(chain_head, chain_head, 0)
    return tl.gather(tl.maximum(first_child_of, 0), chain_head, 0)


@triton.jit
def _ddtree_conv1d_tree_kernel(
    x_ptr, w_ptr, bias_ptr, conv_state_ptr, conv_state_indices_ptr, inter_ptr, inter_indices_ptr,
    next_ptr, sib_ptr, parent_ptr, o_ptr,
    dim, seqlen, num_cache_lines,
    stride_x_seq, stride_x_dim, stride_x_token, stride_w_dim, stride_w_width,
    stride_state_seq, stride_state_dim, stride_state_token, stride_state_indices,
    stride_inter_seq, stride_inter_step, stride_inter_dim, stride_inter_win, stride_inter_indices,
    stride_next_seq, stride_next_token, stride_sib_seq, stride_sib_token, stride_parent_seq,
    stride_parent_token, stride_o_seq, stride_o_dim, stride_o_token,
    pad_slot_id: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    KERNEL_WIDTH: tl.constexpr,
    SILU_ACTIVATION: tl.constexpr,
    NP2_STATELEN: tl.constexpr,
    NP2_SEQLEN: tl.constexpr,
    LOG2_SEQLEN: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SAVE_INTERMEDIATE: tl.constexpr,
):
    seq = tl.program_id(0)
    feats = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    feat_ok = feats < dim
    state_row = tl.load(conv_state_indices_ptr + seq * stride_state_indices).to(tl.int64)
    if state_row == pad_slot_id:  # a padded batch row
        return
    state_len = KERNEL_WIDTH - 1

    # The committed window, oldest first: col0 .. col{K-2}.
    state_base = conv_state_ptr + state_row * stride_state_seq + feats * stride_state_dim
    col0 = tl.load(state_base, feat_ok, 0.0)
    if KERNEL_WIDTH >= 3:
        col1 = tl.load(state_base + stride_state_token, feat_ok, 0.0)
    if KERNEL_WIDTH >= 4:
        col2 = tl.load(state_base + 2 * stride_state_token, feat_ok, 0.0)

    # Roll the conv state as SGLang's kernel does (the commit rewrites it from the accepted node).
    slot = tl.arange(0, NP2_STATELEN)
    x_base = x_ptr + seq * stride_x_seq + feats * stride_x_dim
    kept = (slot + seqlen < state_len)[:, None] & feat_ok[None, :] & (state_row < num_cache_lines)
    old = tl.load(state_base[None, :] + ((slot + seqlen) * stride_state_token)[:, None], kept, other=0.0)
    from_x = (slot - state_len + seqlen >= 0)[:, None] & (slot - state_len < 0)[:, None] & feat_ok[None, :]
    new = tl.load(x_base[None, :] + ((slot - state_len + seqlen) * stride_x_token)[:, None], from_x, 0.0)
    tl.debug_barrier()
    tl.store(state_base[None, :] + (slot * stride_state_token)[:, None], tl.where(kept, old, new),
             (slot < state_len)[:, None] & feat_ok[None, :])

    node = tl.arange(0, NP2_SEQLEN)
    node_ok = node < seqlen
    parent = _tree_parents(next_ptr + seq * stride_next_seq, sib_ptr + seq * stride_sib_seq, stride_next_token,
                           stride_sib_token, seqlen, node, NP2_SEQLEN, LOG2_SEQLEN, CHUNK)
    if tl.program_id(1) == 0:
        tl.store(parent_ptr + seq * stride_parent_seq + node * stride_parent_token, parent, node_ok)

    if HAS_BIAS:
        acc = tl.load(bias_ptr + feats, feat_ok, 0.0).to(tl.float32)[None, :] + tl.zeros((NP2_SEQLEN, BLOCK_N),
                                                                                             tl.float32)
    else:
        acc = tl.zeros((NP2_SEQLEN, BLOCK_N), tl.float32)
    tile_ok = node_ok[:, None] & feat_ok[None, :]
    if SAVE_INTERMEDIATE:
        inter_row = tl.load(inter_indices_ptr + seq * stride_inter_indices).to(tl.int64)
        inter_base = (inter_ptr + inter_row * stride_inter_seq + (node * stride_inter_step)[:, None]
                      + (feats * stride_inter_dim)[None, :])

    # Step j reads the node j generations up (the node itself first); past the root it reads the
    # committed window, newest first. ``at`` is that node, or 0, -1, ... once past the root.
    at = node
    value = tl.load(x_base[None, :] + (node * stride_x_token)[:, None], tile_ok, 0.0)
    for j in tl.static_range(KERNEL_WIDTH):
        if j > 0:
            came_from = at
            in_tree = came_from > 0
            at = tl.where(in_tree, tl.gather(parent, tl.maximum(came_from, 0), 0), came_from - 1)
            parent_value = tl.load(x_base[None, :] + (tl.maximum(at, 0) * stride_x_token)[:, None],
                                   in_tree[:, None] & tile_ok, 0.0)
            if KERNEL_WIDTH == 2:
                committed = col0[None, :]
            elif KERNEL_WIDTH == 3:
                committed = tl.where((came_from == 0)[:, None], col1[None, :], col0[None, :])
            else:
                committed = tl.where((came_from == 0)[:, None], col2[None, :],
                                     tl.where((came_from == -1)[:, None], col1[None, :], col0[None, :]))
            value = tl.where(in_tree[:, None], parent_value, committed)
        if SAVE_INTERMEDIATE:
            if KERNEL_WIDTH - j - 2 >= 0:
                tl.store(inter_base + (KERNEL_WIDTH - j - 2) * stride_inter_win, value, tile_ok)
        w = tl.load(w_ptr + feats * stride_w_dim + (KERNEL_WIDTH - 1 - j) * stride_w_width, feat_ok, 0.0)
        acc += value * w[None, :]

    if SILU_ACTIVATION:
        acc = acc / (1 + tl.exp(-acc))
    o_ptrs = o_ptr + seq * stride_o_seq + (node * stride_o_token)[:, None] + (feats * stride_o_dim)[None, :]
    tl.store(o_ptrs, acc, tile_ok)


def tile_width(nodes: int) -> int:
    """Channels a program takes: its tile of nodes x channels holds about 4,096 values."""
    return max(8, min(128, 4096 // triton.next_power_of_2(nodes)))


def tree_conv_pays(requests: int, dim: int, nodes: int) -> bool:
    """Whether this kernel was measured faster than SGLang's tree mode at these shapes."""
    programs = requests * triton.cdiv(dim, tile_width(nodes))
    return MIN_TREE_NODES <= nodes <= MAX_TREE_NODES and programs <= MAX_PROGRAMS


def ddtree_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    activation: Union[bool, str, None] = None,
    conv_state_indices: Optional[torch.Tensor] = None,
    intermediate_conv_window: Optional[torch.Tensor] = None,
    intermediate_state_indices: Optional[torch.Tensor] = None,
    retrieve_next_token: Optional[torch.Tensor] = None,
    retrieve_next_sibling: Optional[torch.Tensor] = None,
    retrieve_parent_token: Optional[torch.Tensor] = None,
    **kwargs,
) -> torch.Tensor:
    """``causal_conv1d_update`` for a target verify (same arguments, same results): a tree at shapes
    where ``tree_conv_pays`` takes ``ddtree_conv1d_tree``; a chain (no links: DFLASH's grammar
    fallback), other shapes and arguments it does not cover take SGLang's kernel. The choice
    depends on shapes only, so a CUDA graph captures one kernel per batch size.

    x: (batch, dim, nodes); conv_state: (cache lines, dim, state_len); weight: (dim, width).
    """
    covered = (
        retrieve_next_token is not None
        and conv_state_indices is not None
        and kwargs.get("cache_seqlens") is None
        and kwargs.get("num_accept_tokens") is None
        and x.dim() == 3
        and x.dtype == conv_state.dtype
        and 2 <= weight.shape[1] <= 4
        and conv_state.shape[-1] == weight.shape[1] - 1
        and (intermediate_conv_window is None) == (intermediate_state_indices is None)
    )
    if not covered or not tree_conv_pays(x.shape[0], x.shape[1], x.shape[2]):
        return causal_conv1d_update(
            x, conv_state, weight, bias, activation, conv_state_indices=conv_state_indices,
            intermediate_conv_window=intermediate_conv_window, intermediate_state_indices=intermediate_state_indices,
            retrieve_next_token=retrieve_next_token, retrieve_next_sibling=retrieve_next_sibling,
            retrieve_parent_token=retrieve_parent_token, **kwargs,
        )
    return ddtree_conv1d_tree(
        x, conv_state, weight, bias, activation, conv_state_indices=conv_state_indices,
        intermediate_conv_window=intermediate_conv_window, intermediate_state_indices=intermediate_state_indices,
        retrieve_next_token=retrieve_next_token, retrieve_next_sibling=retrieve_next_sibling,
        retrieve_parent_token=retrieve_parent_token, pad_slot_id=kwargs.get("pad_slot_id", PAD_SLOT_ID),
    )


def ddtree_conv1d_tree(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    activation: Union[bool, str, None],
    *,
    conv_state_indices: torch.Tensor,
    intermediate_conv_window: Optional[torch.Tensor],
    intermediate_state_indices: Optional[torch.Tensor],
    retrieve_next_token: torch.Tensor,
    retrieve_next_sibling: torch.Tensor,
    retrieve_parent_token: torch.Tensor,
    pad_slot_id: int = PAD_SLOT_ID,
) -> torch.Tensor:
    """This module's kernel at any tree size (what ``ddtree_conv1d_update`` covers, whatever it pays)."""
    batch, dim, seqlen = x.shape
    width = weight.shape[1]
    if isinstance(activation, bool):
        activation = "silu" if activation else None
    out = torch.empty_like(x)
    np2_seqlen = triton.next_power_of_2(seqlen)
    block_n = tile_width(seqlen)
    inter = intermediate_conv_window if intermediate_conv_window is not None else x.new_empty((1, 1, 1, 1))
    inter_indices = intermediate_state_indices if intermediate_state_indices is not None else conv_state_indices
    _ddtree_conv1d_tree_kernel[(batch, triton.cdiv(dim, block_n))](
        x, weight, bias, conv_state, conv_state_indices, inter, inter_indices,
        retrieve_next_token, retrieve_next_sibling, retrieve_parent_token, out,
        dim, seqlen, conv_state.shape[0],
        *x.stride(), *weight.stride(), *conv_state.stride(), conv_state_indices.stride(0),
        *inter.stride(), inter_indices.stride(0), *retrieve_next_token.stride(), *retrieve_next_sibling.stride(),
        *retrieve_parent_token.stride(), *out.stride(),
        pad_slot_id=pad_slot_id,
        HAS_BIAS=bias is not None,
        KERNEL_WIDTH=width,
        SILU_ACTIVATION=activation in ("silu", "swish"),
        NP2_STATELEN=triton.next_power_of_2(width - 1),
        NP2_SEQLEN=np2_seqlen,
        LOG2_SEQLEN=max(1, (np2_seqlen - 1).bit_length()),
        CHUNK=min(32, np2_seqlen),
        BLOCK_N=block_n,
        SAVE_INTERMEDIATE=intermediate_conv_window is not None,
    )
    return out
