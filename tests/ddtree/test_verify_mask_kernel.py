"""Overlay ddtree 0.3.0-rc.7's verify-mask kernel (``fill_ddtree_verify_mask``) on the CPU, through
Triton's interpreter in a child process (as ``test_tree_build_triton.py`` runs the tree builder).

rc.7 fills the mask inside the prepare CUDA graph, straight into the attention backend's buffer,
where the batch's cells change every replay while the buffer stays: the kernel must write the
FULL_MASK layout the backends read (each request's rows over its prefix then its tree, the tree part
being node-and-ancestors) and must never write past its buffer, whatever the lengths.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

RC7 = "ddtree@0.3.0-rc.7"
KERNEL = "sglang/kernels/ops/speculative/ddtree.py"
UTILS = "sglang/srt/speculative/ddtree_utils.py"
SENTINEL = 7  # a byte no bool cell holds: anything the kernel wrote past its buffer shows


@pytest.fixture(scope="module")
def filled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    from ddtree_deploy.catalog import load_overlay
    from tests.ddtree.conftest import OVERLAYS

    work = tmp_path_factory.mktemp("mask")
    overlay = load_overlay(RC7, OVERLAYS)
    for path in (KERNEL, UTILS):
        (work / Path(path).name).write_bytes(overlay.content_of(path, None))
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    child = subprocess.run([sys.executable, __file__, str(work)], env=env, capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-4000:]
    return torch.load(work / "masks.pt")


def want_layout(filled: dict[str, torch.Tensor]) -> torch.Tensor:
    """The FULL_MASK layout, request by request: N rows of (prefix + N) cells, from the reference mask."""
    utils = _load(Path(filled["work"]) / Path(UTILS).name)
    tree = utils.DDTreeBatch(**filled["tree"])
    rows = []
    for b, prefix in enumerate(filled["prefix"].tolist()):
        rows.append(utils.tree_attention_mask(tree.tree(b), prefix).reshape(-1))  # [N, prefix + N], a real tree's
    return torch.cat(rows)


def test_the_mask_is_each_requests_prefix_then_its_ancestors(filled: dict[str, torch.Tensor]) -> None:
    want = want_layout(filled)
    whole = filled["whole"]
    assert whole[: want.numel()].tolist() == want.to(torch.uint8).tolist()
    assert (whole[want.numel() :] == SENTINEL).all(), "cells past the batch are left untouched"


@pytest.mark.parametrize("cut", ["mid_request", "one_cell"])
def test_a_buffer_too_small_is_filled_up_to_its_end_and_no_further(filled: dict[str, torch.Tensor], cut: str) -> None:
    want = want_layout(filled).to(torch.uint8)
    storage, capacity = filled[cut], int(filled[f"{cut}_capacity"])
    assert 0 < capacity < want.numel()
    assert storage[:capacity].tolist() == want[:capacity].tolist()
    assert (storage[capacity:] == SENTINEL).all(), "the kernel wrote past its buffer"


# --------------------------------------------------------------------------- the child process
def _load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"rc7_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _fill(kernel: ModuleType, visibility: torch.Tensor, prefix: torch.Tensor, storage_cells: int, capacity: int) -> torch.Tensor:
    """Fill a buffer of ``capacity`` cells that is the start of a larger sentinel-filled storage."""
    storage = torch.full((storage_cells,), SENTINEL, dtype=torch.uint8)
    kernel.fill_ddtree_verify_mask(mask_out=storage[:capacity].view(torch.bool), visibility=visibility, prefix_lens=prefix)
    return storage


def _fill_masks(work: Path) -> None:
    assert os.environ["TRITON_INTERPRET"] == "1" and "triton" not in sys.modules
    torch.set_num_threads(1)
    utils, kernel = _load(work / Path(UTILS).name), _load(work / Path(KERNEL).name)
    logits = torch.randn((3, 5, 30), generator=torch.Generator().manual_seed(3)) * 2.0
    tree = utils.build_ddtree_batch(logits, 12)
    prefix = torch.tensor([4, 0, 300])  # the last row needs two of the kernel's 256-cell blocks
    n = tree.visibility.shape[1]
    cells = int((n * (prefix + n)).sum())
    out: dict[str, object] = {"work": str(work), "prefix": prefix,
                              "tree": {f: getattr(tree, f) for f in tree.__dataclass_fields__}}
    out["whole"] = _fill(kernel, tree.visibility, prefix, cells + 600, cells + 300)
    middle = n * (prefix[0] + n) + n * (prefix[1] + n) + 2 * (int(prefix[2]) + n) + 37
    for name, capacity in (("mid_request", int(middle)), ("one_cell", 1)):
        out[name], out[f"{name}_capacity"] = _fill(kernel, tree.visibility, prefix, cells + 600, capacity), capacity
    torch.save(out, work / "masks.pt")


if __name__ == "__main__":
    _fill_masks(Path(sys.argv[1]))
