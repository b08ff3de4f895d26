"""DDTREE Triton kernels: programmatic dependent launch between the tree build's launches.

The build (``ddtree_top_k``'s seven launches, then ``ddtree_build``'s pop loop and visibility kernel) is
nine short kernels in a row, each reading what the one before it wrote. In a CUDA graph the GPU still
lets one kernel drain before it places the next one's programs: 9 us of rc.34's 264 us build at budget
512, batch 1 fell between its kernels (run 38 call 1's parts). On Hopper and later, a launch marked for
programmatic dependent launch may have its programs placed while the launch before it still runs; each
program then waits in ``griddepcontrol.wait`` until that launch has finished and its writes are
visible, before it reads anything.

As SGLang's own Triton kernels do (``causal_conv1d_triton``'s update kernel), every kernel of the build
takes ``USE_GDC``, off by default, and calls ``ddtree_after_previous`` before its first load; its launch
passes ``ddtree_dependent_launch``'s options: ``USE_GDC`` and Triton's ``launch_pdl`` where SGLang's
``is_arch_support_pdl`` says the GPU has them, nothing elsewhere (ROCm, older GPUs, and Triton's
interpreter, whose tensors are on the CPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang.kernels.jit.utils import is_arch_support_pdl


@triton.jit
def ddtree_after_previous(USE_GDC: tl.constexpr):
    """With USE_GDC: waits until the launch before this one has finished and its writes are visible,
    then lets the launch after this one place its programs (they wait here in turn). Without it,
    nothing: an ordinary launch already starts after the one before it."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def ddtree_dependent_launch(device: torch.device) -> dict:
    """The launch options of a build kernel on ``device``: ``USE_GDC`` and ``launch_pdl`` where the
    GPU takes them, none elsewhere."""
    return {"USE_GDC": True, "launch_pdl": True} if device.type == "cuda" and is_arch_support_pdl() else {}
