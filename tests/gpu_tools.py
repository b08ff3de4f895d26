"""tools/gpu's scripts, imported by file path for their CPU tests (tools/gpu is not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

GPU_TOOLS = Path(__file__).resolve().parents[1] / "tools" / "gpu"


def load_gpu_tool(name: str) -> ModuleType:
    """tools/gpu/<name>.py as a module, registered first (a dataclass resolves its annotations
    through sys.modules)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, GPU_TOOLS / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
