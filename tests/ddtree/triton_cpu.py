"""Loading Triton kernel files on a machine without a GPU, for the kernel tests and tools/: a file
as a module under a name of our choosing, and SGLang 0.5.17's conv1d kernel file under its own
name, which overlay ddtree's ``ddtree_conv1d.py`` imports."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_module(path: Path | str, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def sglang_conv_kernel(path: Path | str) -> ModuleType:
    """SGLang's kernel file under its own module name. Its one sglang import asks the GPU whether it
    can launch dependent kernels early; here a stand-in (test and tool only) answers no."""
    for name in ("sglang", "sglang.kernels", "sglang.kernels.jit", "sglang.kernels.ops", "sglang.kernels.ops.mamba"):
        sys.modules.setdefault(name, ModuleType(name))
    jit = ModuleType("sglang.kernels.jit.utils")
    jit.is_arch_support_pdl = lambda: False  # type: ignore[attr-defined]
    sys.modules[jit.__name__] = jit
    return load_module(path, "sglang.kernels.ops.mamba.causal_conv1d_triton")
