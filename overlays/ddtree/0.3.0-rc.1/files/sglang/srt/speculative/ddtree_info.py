"""DDTREE verify input: a DFlash verify input that carries the draft tree's links."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from sglang.srt.speculative.dflash_info import DFlashVerifyInput


@dataclass
class DDTreeVerifyInput(DFlashVerifyInput):
    """Inputs of a DDTREE target verify: ``[root] + nodes`` under the tree mask.

    A hybrid linear-attention backend runs its tree kernels (conv window over
    ancestors, recurrence from the parent's state) for a verify input of this type,
    although DDTREE's ``speculative_eagle_topk`` is 1; the grammar fallback's DFlash
    chain round verifies a plain ``DFlashVerifyInput`` through the same backend.
    During CUDA-graph capture the links are None and the backend's static buffers
    stand in for them.
    """

    # First child of each node, -1 if none (SGLang's tree layout). Shape: [bs, budget + 1].
    retrieve_next_token: Optional[torch.Tensor] = None
    # Next sibling of each node, -1 if none. Shape: [bs, budget + 1].
    retrieve_next_sibling: Optional[torch.Tensor] = None
