"""Fixtures for the DDTree core tests: the overlay's ddtree_utils.py and its CPU decode tool,
imported by file path (no sglang install needed), and the logit families the tests share."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

OVERLAY = Path(__file__).resolve().parents[2] / "overlays" / "ddtree"
DDTREE_UTILS = OVERLAY / "0.1.0/files/sglang/srt/speculative/ddtree_utils.py"
DECODE_TOOL = OVERLAY / "tools/ddtree_cpu_decode.py"
# 0.2.1 adds the round's tensor programs (verify inputs, commit plan) beside the same core.
DDTREE_UTILS_021 = OVERLAY / "0.2.1/files/sglang/srt/speculative/ddtree_utils.py"


def load_by_path(name: str, path: Path) -> ModuleType:
    """Import a module from a file; registered in sys.modules first (dataclasses need it)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="session")
def dd() -> ModuleType:
    """The overlay's sglang/srt/speculative/ddtree_utils.py."""
    return load_by_path("ddtree_utils_overlay", DDTREE_UTILS)


@pytest.fixture(scope="session")
def dd021() -> ModuleType:
    """Overlay 0.2.1's ddtree_utils.py (the copy the 0.2.1 worker imports)."""
    return load_by_path("ddtree_utils_overlay_021", DDTREE_UTILS_021)


@pytest.fixture(scope="session")
def decode_tool() -> ModuleType:
    """overlays/ddtree/tools/ddtree_cpu_decode.py (shares the same ddtree_utils module)."""
    return load_by_path("ddtree_cpu_decode", DECODE_TOOL)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny tensors: extra intra-op threads only contend (on a loaded 2-core machine a
    log_softmax of 10 values took 5 ms with 2 threads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _sharp(g: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(shape, generator=g) * 6.0


def _flat(g: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(shape, generator=g) * 0.05


def _bf16(g: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    # bf16 keeps 8 mantissa bits: many exactly equal log-probs, so ties decide the tree.
    return (torch.randn(shape, generator=g) * 2.0).to(torch.bfloat16)


def _integer(g: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randint(-3, 2, shape, generator=g).float()


def _masked(g: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    # Masked vocabulary: -inf on most columns, some rows with a single finite token.
    logits = torch.randn(shape, generator=g)
    keep = torch.rand(shape, generator=g) < 0.3
    keep[..., 0] = True
    return logits.masked_fill(~keep, float("-inf"))


LOGIT_FAMILIES: dict[str, Callable[[torch.Generator, tuple[int, ...]], torch.Tensor]] = {
    "sharp": _sharp,
    "flat": _flat,
    "bf16": _bf16,
    "integer": _integer,
    "masked": _masked,
}


@pytest.fixture(scope="session")
def make_logits() -> Callable[[str, tuple[int, ...], int], torch.Tensor]:
    """`make_logits(family, shape, seed)` with family one of LOGIT_FAMILIES."""

    def make(family: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
        return LOGIT_FAMILIES[family](torch.Generator().manual_seed(seed), shape)

    return make
