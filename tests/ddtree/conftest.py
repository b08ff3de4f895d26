"""Fixtures for the DDTree core tests: the newest ddtree version's ddtree_utils.py (resolved through
`inherits` and `edits`, loaded by the decode tool), the CPU decode tool itself, imported by file path
(no sglang install needed), the logit families the tests share, and the distribution the release's
torch sampler draws from (`plain_distribution`)."""

from __future__ import annotations

import ast
import importlib.util
import sys
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

from ddtree_deploy.pristine import pristine_release
from tests.overlay.plan_digests import BASE

OVERLAYS = Path(__file__).resolve().parents[2] / "overlays"
DECODE_TOOL = OVERLAYS / "ddtree/tools/ddtree_cpu_decode.py"
DDTREE_UTILS = "sglang/srt/speculative/ddtree_utils.py"


def load_tool() -> ModuleType:
    """overlays/ddtree/tools/ddtree_cpu_decode.py, imported by file path (registered first: dataclasses need it)."""
    name = "ddtree_cpu_decode"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, DECODE_TOOL)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="session")
def dd() -> ModuleType:
    """The newest ddtree version's sglang/srt/speculative/ddtree_utils.py (the decode tool's too)."""
    return load_tool().load_ddtree_utils()


@pytest.fixture(scope="session")
def dd010() -> ModuleType:
    """Release 0.1.0's ddtree_utils.py, for what only its core has (the newest does not carry it yet):
    several float64 fold-replay passes (`sibling_fold_passes=`) and the summary's top-1 agreement."""
    return load_tool().load_ddtree_utils("ddtree@0.1.0")


@pytest.fixture(scope="session")
def decode_tool() -> ModuleType:
    """overlays/ddtree/tools/ddtree_cpu_decode.py (it imports the same newest ddtree_utils module)."""
    return load_tool()


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


# --------------------------------------------------------------------------- plain decoding's sampler
PLAIN = "top_k_top_p_min_p_sampling_from_probs_torch"


class RecordingTorch(SimpleNamespace):
    """torch, except that multinomial records the (unnormalised) probabilities it samples from."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    def multinomial(self, probs: torch.Tensor, num_samples: int) -> torch.Tensor:
        self.sampled_from = probs.clone()
        return torch.zeros(probs.shape[0], num_samples, dtype=torch.int64)


def lift_release(path: str, names: list[str], namespace: dict[str, Any]) -> dict[str, Any]:
    """The named top-level functions of the SGLang release's file at ``path`` (inside the
    package), defined into ``namespace`` (which supplies what they use); returns ``namespace``."""
    body = ast.parse((pristine_release(BASE) / path).read_text()).body
    nodes = [n for n in body if isinstance(n, ast.FunctionDef) and n.name in names]
    assert sorted(n.name for n in nodes) == sorted(names), f"{path} lacks one of {names}"
    exec(compile(ast.Module(body=nodes, type_ignores=[]), Path(path).name, "exec"), namespace)
    return namespace


@pytest.fixture(scope="session")
def plain_distribution() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    recorder = RecordingTorch()
    namespace = lift_release("sglang/srt/layers/sampler.py", [PLAIN], {
        "torch": recorder, "Optional": typing.Optional, "multinomial_with_seed": None})

    def distribution(probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
        """The distribution plain decoding samples each row of `probs` from."""
        namespace[PLAIN](probs, top_ks, top_ps, torch.zeros(len(probs)), False, None, None)
        order = probs.sort(dim=-1, descending=True)[1]  # the sampler's own sort of the same rows
        kept = torch.zeros_like(probs).scatter(1, order, recorder.sampled_from)
        return kept / kept.sum(-1, keepdim=True)

    return distribution
