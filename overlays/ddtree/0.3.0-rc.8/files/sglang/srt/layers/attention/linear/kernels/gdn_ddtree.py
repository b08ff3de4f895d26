"""The GDN kernel a DDTREE server verifies its trees with (GDNKernelDispatcher.tree_verify_kernel)."""

import torch

from sglang.kernels.ops.speculative.ddtree_gdn import (
    ddtree_gdn_tree_verify,
    depth_steps_pay,
    verify_items,
)
from sglang.srt.layers.attention.linear.kernels.gdn_triton import TritonGDNKernel


class DDTreeGDNKernel(TritonGDNKernel):
    """Triton's GDN kernels, with the tree verify run in depth steps (``ddtree_gdn.py``) where that
    pays: a DDTree at budget B has B + 1 nodes but at most a draft block's depth, where SGLang's tree
    mode steps through every node in turn. Where SGLang's own grid already fills the GPU (many
    requests of a large model at small budgets), its kernel keeps the call (``depth_steps_pay``).
    The choice depends on shapes only, so a CUDA graph captures one kernel per batch size."""

    def target_verify(
        self,
        A_log: torch.Tensor,
        dt_bias: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        *,
        ssm_states: torch.Tensor,
        cache_indices: torch.Tensor,
        query_start_loc: torch.Tensor,
        intermediate_states_buffer: torch.Tensor,
        intermediate_state_indices: torch.Tensor,
        cache_steps: int,
        retrieve_parent_token: torch.Tensor,
        **kwargs,
    ) -> torch.Tensor:
        requests = query_start_loc.numel() - 1
        if not depth_steps_pay(verify_items(requests, v.shape[2], v.shape[3]), intermediate_states_buffer.shape[1]):
            return super().target_verify(
                A_log, dt_bias, q, k, v, a, b, ssm_states=ssm_states, cache_indices=cache_indices,
                query_start_loc=query_start_loc, intermediate_states_buffer=intermediate_states_buffer,
                intermediate_state_indices=intermediate_state_indices, cache_steps=cache_steps,
                retrieve_parent_token=retrieve_parent_token, **kwargs,
            )
        return ddtree_gdn_tree_verify(
            A_log,
            a,
            dt_bias,
            q,
            k,
            v,
            b,
            initial_state_source=ssm_states,
            initial_state_indices=cache_indices,
            cu_seqlens=query_start_loc,
            intermediate_states_buffer=intermediate_states_buffer,
            intermediate_state_indices=intermediate_state_indices,
            retrieve_parent_token=retrieve_parent_token,
        )
