"""Loading Triton kernel files on a machine without a GPU, for the kernel tests and tools/: a file
as a module under a name of our choosing, SGLang 0.5.17's conv1d kernel file under its own
name, which overlay ddtree's ``ddtree_conv1d.py`` imports, a stand-in for the sglang module both
ask whether the GPU launches dependent kernels early, and a kernel's PTX for an H100 or H200."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any


def load_module(path: Path | str, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def stand_in_pdl_check() -> ModuleType:
    """A stand-in (tests and tools only) for ``sglang.kernels.jit.utils``, the one sglang module SGLang's
    Triton kernels and overlay ddtree's kernel modules import: its ``is_arch_support_pdl``, which asks the
    GPU whether it can launch dependent kernels early, answers no."""
    for name in ("sglang", "sglang.kernels", "sglang.kernels.jit", "sglang.kernels.ops", "sglang.kernels.ops.mamba",
                 "sglang.kernels.ops.speculative"):
        sys.modules.setdefault(name, ModuleType(name))
    jit = ModuleType("sglang.kernels.jit.utils")
    jit.is_arch_support_pdl = lambda: False  # type: ignore[attr-defined]
    sys.modules[jit.__name__] = jit
    return jit


def sglang_conv_kernel(path: Path | str) -> ModuleType:
    """SGLang's kernel file under its own module name, its sglang import answered by the stand-in."""
    stand_in_pdl_check()
    return load_module(path, "sglang.kernels.ops.mamba.causal_conv1d_triton")


def hopper_ptx(kernel: Any, signature: dict[str, str], constants: dict[str, Any], warps: int,
               attrs: dict[tuple[int, ...], Any] | None = None) -> str:
    """The PTX Triton's own CUDA backend makes of ``kernel`` for sm_90 (an H100's or H200's), on a machine
    without a GPU; the local Triton may be newer than a GPU machine's."""
    import triton
    from triton.backends.compiler import GPUTarget

    hopper = GPUTarget("cuda", 90, 32)
    source = triton.compiler.ASTSource(fn=kernel, constexprs=constants, signature=signature, attrs=attrs)
    options = triton.compiler.make_backend(hopper).parse_options({"num_warps": warps})
    return str(triton.compile(source, target=hopper, options=options.__dict__).asm["ptx"])
