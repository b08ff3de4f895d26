"""Overlay ddtree 0.3.0-rc.21's and rc.22's Triton dispatch: each op is looked up in the kernel module that
defines it (rc.21 moved the log-probs and top-K kernels from ``ddtree_build.py`` to ``ddtree_top_k.py``), and
the core's bound on the Triton top-K's k is that module's (rc.16's, rc.21's and rc.22's).

``_ddtree_triton_op`` gives None (the torch code) on an ImportError, which is right where Triton is missing,
but would also hide a wrong module name on a GPU: the build would run, slower, with nothing said. From
rc.22 the kernel module itself missing raises. The interpreter tests and the benches point the dispatch at
their kernels themselves, so only this test runs the lookup. It imports the dispatch against a stand-in
``sglang`` package (the real one needs CUDA's Triton): each kernel module of the version, with a marker
under every name its real file defines at its top level.
"""

from __future__ import annotations

import ast
import functools
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any
from unittest import mock

import pytest
import torch

from ddtree_deploy.catalog import load_overlay
from tests.ddtree.conftest import OVERLAYS

RC16 = "ddtree@0.3.0-rc.16"
RC21 = "ddtree@0.3.0-rc.21"
RC22 = "ddtree@0.3.0-rc.22"  # the top-K from the logits
KERNELS = "sglang/kernels/ops/speculative"
UTILS = "sglang/srt/speculative/ddtree_utils.py"


@functools.cache  # resolving a version applies every edit of its chain
def kernel_source(spec: str, module: str) -> ast.Module:
    return ast.parse(load_overlay(spec, OVERLAYS).content_of(f"{KERNELS}/{module}.py", None).decode())


def defined_names(spec: str, module: str) -> list[str]:
    """The functions a version's kernel module defines at its top level."""
    return sorted(node.name for node in kernel_source(spec, module).body if isinstance(node, ast.FunctionDef))


@pytest.fixture
def stand_in_kernels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spec: str) -> Iterator[Path]:
    """The test's version's two kernel modules as a stand-in package (its folder): ``<module>.<name>`` strings
    under the names the version's real files define."""
    package = tmp_path / KERNELS
    package.mkdir(parents=True)
    for folder in (package, *package.parents[: len(Path(KERNELS).parts) - 1]):
        (folder / "__init__.py").write_text("")
    for module in ("ddtree_build", "ddtree_top_k"):
        markers = "".join(f"{name} = {module + '.' + name!r}\n" for name in defined_names(spec, module))
        (package / f"{module}.py").write_text(markers)
    monkeypatch.syspath_prepend(str(tmp_path))
    with mock.patch.dict(sys.modules):  # the stand-in leaves with the test, and any real sglang comes back
        for name in [n for n in sys.modules if n == "sglang" or n.startswith("sglang.")]:
            del sys.modules[name]
        yield package


@pytest.fixture
def load_core(decode_tool: ModuleType) -> Iterator[Callable[[str], ModuleType]]:
    """Loads a version's core, its lookup's cache cleared: no answer from before the stand-in, none after it."""
    lookups: list[Any] = []

    def load(spec: str) -> ModuleType:
        core: ModuleType = decode_tool.load_overlay_module(spec, UTILS)
        lookups.append(core.build_ddtree_tree.__globals__["_ddtree_triton_op"])
        lookups[-1].cache_clear()
        return core

    yield load
    for lookup in lookups:
        lookup.cache_clear()


@pytest.mark.parametrize("spec", [RC21, RC22])
def test_each_op_is_looked_up_where_its_kernel_lives(stand_in_kernels: Path, load_core: Callable[[str], ModuleType], spec: str) -> None:
    core = load_core(spec)
    tree, builder = core.build_ddtree_tree.__globals__, core.build_ddtree_batch.__globals__
    cuda = torch.device("cuda")
    assert tree["_ddtree_triton_top_k"](cuda) == "ddtree_top_k.ddtree_top_k_triton"
    assert tree["_ddtree_triton_log_probs"](cuda) == "ddtree_top_k.ddtree_log_probs_triton"
    assert builder["_ddtree_triton_builder"](cuda) == "ddtree_build.build_ddtree_trees_triton"


@pytest.mark.parametrize("spec", [RC21, RC22])
def test_without_the_kernels_the_dispatch_gives_the_torch_code(load_core: Callable[[str], ModuleType], spec: str) -> None:
    """The CPU tests' own case: no sglang to import, so None, not an error."""
    assert load_core(spec).build_ddtree_tree.__globals__["_ddtree_triton_top_k"](torch.device("cuda")) is None


@pytest.mark.parametrize(("spec", "raises"), [(RC21, False), (RC22, True)])
def test_a_kernel_module_missing_from_sglang_raises_from_rc22(stand_in_kernels: Path, load_core: Callable[[str], ModuleType],
                                                             spec: str, raises: bool) -> None:
    """An sglang without the top-K's module (a broken overlay): rc.21 ran the torch code in its place,
    rc.22 says so. The tree build's module, still there, is found either way."""
    (stand_in_kernels / "ddtree_top_k.py").unlink()
    core = load_core(spec)
    tree, builder = core.build_ddtree_tree.__globals__, core.build_ddtree_batch.__globals__
    cuda = torch.device("cuda")
    if raises:
        with pytest.raises(ModuleNotFoundError, match="ddtree_top_k"):
            tree["_ddtree_triton_top_k"](cuda)
    else:
        assert tree["_ddtree_triton_top_k"](cuda) is None
    assert builder["_ddtree_triton_builder"](cuda) == "ddtree_build.build_ddtree_trees_triton"


@pytest.mark.parametrize(("spec", "module"), [(RC16, "ddtree_build"), (RC21, "ddtree_top_k"), (RC22, "ddtree_top_k")])
def test_the_core_knows_the_kernels_widest_k(decode_tool: ModuleType, spec: str, module: str) -> None:
    """The core's bound is the kernel module's (read from its source: the core imports it lazily)."""
    core = decode_tool.load_overlay_module(spec, UTILS)
    bound = next(node for node in kernel_source(spec, module).body if isinstance(node, ast.Assign)
                 and ast.unparse(node.targets[0]) == "DDTREE_TOP_K_MAX_K")
    assert ast.literal_eval(bound.value) == core.build_ddtree_tree.__globals__["_DDTREE_TRITON_TOP_K_MAX_K"]
