"""DDTREE Triton kernels: the target-verify tree mask in the FULL_MASK layout."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _ddtree_fill_verify_mask_kernel(
    mask_ptr,
    visibility_ptr,
    prefix_lens_ptr,
    mask_starts_ptr,
    num_verify: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One program per (request, query row): the committed prefix is visible, then
    # the row of the tree visibility matrix (the node and its ancestors).
    req = tl.program_id(0)
    row = tl.program_id(1)
    prefix = tl.load(prefix_lens_ptr + req).to(tl.int64)
    row_len = prefix + num_verify
    base = tl.load(mask_starts_ptr + req).to(tl.int64) + row * row_len
    vis_row = visibility_ptr + (req * num_verify + row) * num_verify
    for start in range(0, row_len, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        in_row = cols < row_len
        in_tree = (cols >= prefix) & in_row
        vis = tl.load(vis_row + (cols - prefix), mask=in_tree, other=0)
        allowed = tl.where(in_tree, vis != 0, in_row)
        tl.store(mask_ptr + base + cols, allowed, mask=in_row)


def fill_ddtree_verify_mask(
    *,
    mask_out: torch.Tensor,
    visibility: torch.Tensor,
    prefix_lens: torch.Tensor,
) -> None:
    """Write the target-verify mask of a batch of trees, with no host sync.

    Request r owns ``N * (prefix_r + N)`` cells starting at
    ``sum_{j<r} N * (prefix_j + N)``, row-major over (query, key); keys are the
    committed prefix then the ``N`` verify tokens. This is the layout the Triton
    and FlashInfer backends read through ``mask_indptr``.

    Args:
        mask_out: bool ``[>= N * sum(prefix_lens) + bs * N * N]``; cells past the
            batch are left untouched.
        visibility: bool ``[bs, N, N]``; row i is node i and its ancestors (root = 0).
        prefix_lens: int ``[bs]``, committed tokens before the root.
    """
    if visibility.ndim != 3 or visibility.shape[1] != visibility.shape[2]:
        raise ValueError(
            f"visibility must be [bs, N, N], got shape={tuple(visibility.shape)}."
        )
    bs, num_verify = int(visibility.shape[0]), int(visibility.shape[1])
    if bs == 0:
        return
    cells = num_verify * (prefix_lens.to(torch.int64) + num_verify)
    mask_starts = torch.cumsum(cells, dim=0) - cells
    _ddtree_fill_verify_mask_kernel[(bs, num_verify)](
        mask_out,
        visibility.contiguous().view(torch.uint8),
        prefix_lens,
        mask_starts,
        num_verify=num_verify,
        BLOCK=256,
    )
