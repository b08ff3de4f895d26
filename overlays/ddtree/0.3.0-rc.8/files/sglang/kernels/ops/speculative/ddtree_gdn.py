"""DDTREE's GatedDeltaNet tree verify: the recurrence over a draft tree in depth steps, not node steps.

SGLang's tree mode of ``fused_sigmoid_gating_delta_rule_update`` walks a request's T tree nodes one
after another in one program, storing each node's state and loading its parent's back, so a DDTREE
verify at budget B costs B + 1 dependent steps where DFLASH's chain costs the block size. A DDTree is
wide and shallow (its depth is bounded by the draft block), so this kernel splits it into chains of
first children: node 0's chain, and one chain for every node that is not its parent's first child.
One program walks one chain, keeping the state in registers; a chain starts from its head's parent's
state once the program that owns the parent has published it. The steps in a row are the tree's
depth, and the work is still one step per node.

Every node runs SGLang's per-step arithmetic on the same inputs, and a chain head starts from the
parent's state as stored (rounded to the buffer's dtype), as SGLang's kernel reloads it, so the
per-node states and outputs are the ones SGLang's tree mode computes (``tests/ddtree/
test_gdn_depth_kernel.py`` checks it bit for bit in Triton's interpreter). Two inputs SGLang's
builders never produce are handled otherwise: a row without a state slot (index -1) starts every
chain from zeros where SGLang runs the row as a chain, and a parent that is not an earlier node of
its row is read as the root, so the tree stays a tree and no wait can be on a node nobody computes.

Publishing: a program takes a ticket from its item's counter when it starts, and the ticket, not
the grid index, names its node, in increasing order. A chain head only waits for a node of a smaller
index, whose chain started before it did, and a chain never waits after its head, so every wait
ends (the ordering CUB's decoupled look-back relies on). A row is never walked past the buffer's
width, so every chain ends.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gdn_step(b_h, p_q, p_k, p_v, p_b, p_a, b_A_log, b_dt_bias, mask_k, mask_v, softplus_beta,
              softplus_threshold, scale, USE_QK_L2NORM_IN_KERNEL: tl.constexpr):
    # SGLang's step (fused_sigmoid_gating_recurrent.py, the GDN branch), op for op.
    b_q = tl.load(p_q, mask=mask_k, other=0).to(tl.float32)
    b_k = tl.load(p_k, mask=mask_k, other=0).to(tl.float32)
    b_v = tl.load(p_v, mask=mask_v, other=0).to(tl.float32)
    b_b = tl.load(p_b).to(tl.float32)
    b_a = tl.load(p_a).to(tl.float32)
    x = b_a + b_dt_bias
    beta_x = softplus_beta * x
    softplus_x = tl.where(beta_x <= softplus_threshold, (1.0 / softplus_beta) * tl.log(1.0 + tl.exp(beta_x)), x)
    b_g = -tl.exp(b_A_log) * softplus_x
    b_beta = 1.0 / (1.0 + tl.exp(-b_b))
    if USE_QK_L2NORM_IN_KERNEL:
        b_q = b_q / (tl.sqrt(tl.sum(b_q * b_q) + 1e-6))
        b_k = b_k / (tl.sqrt(tl.sum(b_k * b_k) + 1e-6))
    b_q = b_q * scale
    b_h *= tl.exp(b_g)
    b_v -= tl.sum(b_h * b_k[:, None], 0)
    b_v *= b_beta
    b_h += b_k[:, None] * b_v[None, :]
    b_o = tl.sum(b_h * b_q[:, None], 0)
    return b_h, b_o


@triton.jit
def ddtree_gdn_tree_verify_kernel(
    A_log, a, dt_bias, softplus_beta, softplus_threshold,
    q, k, v, b, o,
    h0_source, h0_indices, stride_h0_source, cu_seqlens,
    states, state_indices, cache_steps,
    parents, stride_parents_seq, stride_parents_token,
    sync,
    scale, stride_a, stride_q, stride_k, stride_v, stride_b,
    NP2_T: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, ITEMS,
    USE_QK_L2NORM_IN_KERNEL: tl.constexpr,
):
    # An item is one (request, value head, value block), ITEMS of them. sync[item] counts the item's
    # tickets, sync[ITEMS + node * ITEMS + item] is the node's published flag. One counter per item,
    # not one for the grid: a single counter serialised every program's atomic (0.42 ms at 27B's
    # shapes, 4 requests, budget 64; run 22).
    item = tl.program_id(0) % ITEMS
    node = tl.atomic_add(sync + item, 1)
    NV: tl.constexpr = (V + BV - 1) // BV
    i_nh, i_v = item // NV, item % NV
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    length = tl.minimum(tl.load(cu_seqlens + i_n + 1) - tl.load(cu_seqlens + i_n), cache_steps).to(tl.int32)

    idx = tl.arange(0, NP2_T)
    in_row = (idx > 0) & (idx < length)
    par = tl.load(parents + i_n * stride_parents_seq + idx * stride_parents_token, mask=in_row, other=-1)
    par = tl.where(in_row & ((par < 0) | (par >= idx)), 0, par)  # see the module docstring
    parent = tl.sum(tl.where(idx == node, par, 0))
    first_child_of_parent = tl.min(tl.where((idx > 0) & (par == parent), idx, NP2_T))
    if (node < length) & ((node == 0) | (first_child_of_parent != node)):
        o_k = tl.arange(0, BK)
        o_v = i_v * BV + tl.arange(0, BV)
        mask_k = o_k < K
        mask_v = o_v < V
        mask_h = mask_k[:, None] & mask_v[None, :]
        tile = i_hv * K * V + o_v[None, :] * K + o_k[:, None]
        cache_idx = tl.load(state_indices + i_n).to(tl.int64)
        node_states = states + cache_idx * cache_steps * HV * K * V
        flags = sync + ITEMS + item
        b_h = tl.zeros([BK, BV], dtype=tl.float32)
        if node == 0:
            slot = tl.load(h0_indices + i_n).to(tl.int64)
            if slot >= 0:
                b_h += tl.load(h0_source + slot * stride_h0_source + tile, mask=mask_h, other=0).to(tl.float32)
        else:
            # One thread polls (Triton shares a scalar atomic's result through shared memory), and
            # the state is read through L2 (.cg), where the parent's program published it.
            published = tl.atomic_add(flags + parent * ITEMS, 0, sem="acquire", scope="gpu")
            while published == 0:
                published = tl.atomic_add(flags + parent * ITEMS, 0, sem="acquire", scope="gpu")
            if cache_idx >= 0:
                b_h = tl.load(node_states + parent * HV * K * V + tile, mask=mask_h, other=0,
                              cache_modifier=".cg").to(tl.float32)
        b_A_log = tl.load(A_log + i_hv).to(tl.float32)
        b_dt_bias = tl.load(dt_bias + i_hv).to(tl.float32)
        t = node.to(tl.int32)
        while t < length:
            tok = bos + t
            b_h, b_o = _gdn_step(b_h, q + tok * stride_q + i_h * K + o_k, k + tok * stride_k + i_h * K + o_k,
                                 v + tok * stride_v + i_hv * V + o_v, b + tok * stride_b + i_hv,
                                 a + tok * stride_a + i_hv, b_A_log, b_dt_bias, mask_k, mask_v, softplus_beta,
                                 softplus_threshold, scale, USE_QK_L2NORM_IN_KERNEL)
            tl.store(o + (tok * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=mask_v)
            if cache_idx >= 0:
                stored = b_h.to(states.dtype.element_ty)
                tl.store(node_states + t * HV * K * V + tile, stored, mask=mask_h)
                b_h = stored.to(tl.float32)  # the child starts from the stored state, as SGLang's reload
            tl.debug_barrier()  # every thread's stores before the one thread's release (Triton adds none)
            tl.atomic_xchg(flags + t * ITEMS, 1, sem="release", scope="gpu")
            t = tl.min(tl.where((idx > 0) & (par == t), idx, NP2_T))  # the first child; NP2_T at a leaf


# Where the depth steps pay, from bench/gdn_tree_verify.py on an H200 (run 22, call 3; an item is
# one request's value head and value block, 192 per request at Qwen3.6-27B's shapes): at 192 items
# or fewer the depth kernel was 1.0-1.9x faster than SGLang's at budgets 16-256 (11x on the tiny
# hybrid at 256); at 768 items it was slower at budgets 16 and 64 (1.45x, 1.07x) and faster at 256
# (1.2x). There the serial kernel's own grid already fills the GPU and both move the same states.
DEPTH_KERNEL_MAX_ITEMS = 256
DEPTH_KERNEL_MIN_WIDTH_ANY_ITEMS = 257


def depth_steps_pay(items: int, width: int) -> bool:
    """Whether a tree verify of ``width`` nodes over ``items`` (request, value head, value block)
    items should run in depth steps (this kernel) rather than SGLang's node steps. Measured points
    only: between budget 64 and 256 at many items SGLang's kernel keeps the call."""
    return items <= DEPTH_KERNEL_MAX_ITEMS or width >= DEPTH_KERNEL_MIN_WIDTH_ANY_ITEMS


def verify_items(requests: int, value_heads: int, value_dim: int) -> int:
    """The depth kernel's items: one per request, value head and value block (the block is SGLang's)."""
    return requests * value_heads * triton.cdiv(value_dim, min(triton.next_power_of_2(value_dim), 32))


def ddtree_gdn_tree_verify(
    A_log: torch.Tensor,
    a: torch.Tensor,
    dt_bias: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    b: torch.Tensor,
    *,
    initial_state_source: torch.Tensor,
    initial_state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    intermediate_states_buffer: torch.Tensor,
    intermediate_state_indices: torch.Tensor,
    retrieve_parent_token: torch.Tensor,
    use_qk_l2norm_in_kernel: bool = True,
    softplus_beta: float = 1.0,
    softplus_threshold: float = 20.0,
    scale: float | None = None,
) -> torch.Tensor:
    """The tree verify of ``fused_sigmoid_gating_delta_rule_update`` (GDN gates, no KDA, state
    update disabled, every node's state cached): ``q``/``k`` ``[1, tokens, H, K]``, ``v``
    ``[1, tokens, HV, V]``, ``a``/``b`` ``[tokens, HV]``, requests delimited by ``cu_seqlens``;
    ``retrieve_parent_token[n, t]`` is node t's parent (node 0's entry is ignored), smaller than t.
    Node t's state goes to ``intermediate_states_buffer[intermediate_state_indices[n], t]``.
    Returns the outputs ``[1, tokens, HV, V]``."""
    _, tokens, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    N = cu_seqlens.numel() - 1
    steps = intermediate_states_buffer.shape[1]
    BK, BV = triton.next_power_of_2(K), min(triton.next_power_of_2(V), 32)  # SGLang's blocks
    items = verify_items(N, HV, V)
    sync = torch.zeros((1 + steps) * items, dtype=torch.int32, device=q.device)
    o = q.new_empty(1, tokens, HV, V)
    ddtree_gdn_tree_verify_kernel[(steps * items,)](
        A_log, a, dt_bias, softplus_beta, softplus_threshold,
        q, k, v, b, o,
        initial_state_source, initial_state_indices, initial_state_source.stride(0), cu_seqlens,
        intermediate_states_buffer, intermediate_state_indices, steps,
        retrieve_parent_token, retrieve_parent_token.stride(0), retrieve_parent_token.stride(1),
        sync,
        K**-0.5 if scale is None else scale, a.stride(-2), q.stride(1), k.stride(1), v.stride(1), b.stride(-2),
        NP2_T=triton.next_power_of_2(steps), H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, ITEMS=items,
        USE_QK_L2NORM_IN_KERNEL=use_qk_l2norm_in_kernel,
        num_warps=1, num_stages=3,
    )
    return o
