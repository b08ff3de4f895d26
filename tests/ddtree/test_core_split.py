"""Overlay ddtree 0.3.0-rc.18: rc.17's 1,032-line ddtree_utils.py split in three, on the CPU.

rc.18 derives ``ddtree_tree.py`` (the tree types, the top-K, the reference heap) and
``ddtree_builder.py`` (the batch builder) from rc.17's ``ddtree_utils.py`` and keeps what a round does
with its trees in ``ddtree_utils.py``, which re-exports the builders. A split moves code, it does not
change it:

- every top-level definition of rc.17's module is in exactly one of rc.18's three, byte for byte
  (one comment names the module its constant moved to);
- rc.18's ``ddtree_utils`` exports what rc.17's did, and both give the same trees, links, walks,
  verify inputs, commit plans and KV moves on every logit family of the core tests;
- no module the newest overlay version lands is over 600 lines (the house rule rc.17 broke).

The decode tool loads rc.18's ``ddtree_utils`` with its two siblings, each seen under its sglang name
only while it loads.
"""

from __future__ import annotations

import ast
import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from ddtree_deploy.catalog import load_overlay
from ddtree_deploy.overlay import versions_in
from tests.ddtree.conftest import DDTREE_UTILS, LOGIT_FAMILIES, OVERLAYS, load_tool
from tests.ddtree.test_commit_moves import walk_picks

RC17, RC18 = "ddtree@0.3.0-rc.17", "ddtree@0.3.0-rc.18"
SPECULATIVE = "sglang/srt/speculative"
SPLIT = [f"{SPECULATIVE}/{name}.py" for name in ("ddtree_tree", "ddtree_builder", "ddtree_utils")]
RENAMED = ("# _DDTREE_SIBLING_FOLD_PASSES)", "# ddtree_builder._DDTREE_SIBLING_FOLD_PASSES)")


def source_of(spec: str, path: str) -> str:
    return load_overlay(spec, OVERLAYS).content_of(path, None).decode()


def definitions(source: str) -> dict[str, str]:
    """Each top-level def, class and constant of a module (decorators included), by name."""
    lines = source.splitlines(keepends=True)
    found = {}
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            name = node.name
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
            name = getattr(target, "id", "")
        else:
            continue
        first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
        found[name] = "".join(lines[first - 1: node.end_lineno])
    return found


def test_every_definition_moved_byte_for_byte() -> None:
    before = definitions(source_of(RC17, DDTREE_UTILS).replace(*RENAMED))
    after = [source_of(RC18, path) for path in SPLIT]
    assert len(before) > 40
    names = [name for source in after for name in definitions(source)]
    assert sorted(names) == sorted(before), "rc.18 defines rc.17's names, each once, and no other"
    for name, text in before.items():
        homes = [path for path, source in zip(SPLIT, after, strict=True) if text in source]
        if name == "__all__":
            assert homes == [f"{SPECULATIVE}/ddtree_utils.py"], "the core's one import keeps its exports"
            continue
        assert len(homes) == 1, (name, homes)


@pytest.fixture(scope="module")
def cores() -> tuple[ModuleType, ModuleType]:
    tool = load_tool()
    return tool.load_ddtree_utils(RC17), tool.load_ddtree_utils(RC18)


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if dataclasses.is_dataclass(a):
        return all(same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def test_the_split_loads_with_its_siblings_only_while_it_loads(cores: tuple[ModuleType, ModuleType]) -> None:
    _, rc18 = cores
    assert rc18.build_ddtree_batch.__module__ == "ddtree_builder_0_3_0_rc_18"
    assert rc18.DDTree.__module__ == "ddtree_tree_0_3_0_rc_18"
    assert not any(name.startswith("sglang.srt.speculative.ddtree") for name in sys.modules)


@pytest.mark.parametrize("family", sorted(LOGIT_FAMILIES))
@pytest.mark.parametrize("budget", [16, 60])
def test_the_split_exports_and_computes_what_rc17_did(cores: tuple[ModuleType, ModuleType],
                                                      make_logits: Callable[..., torch.Tensor],
                                                      family: str, budget: int) -> None:
    rc17, rc18 = cores
    assert sorted(rc18.__all__) == sorted(rc17.__all__) and all(hasattr(rc18, n) for n in rc17.__all__)
    logits = make_logits(family, (3, 7, 40), budget)
    g = torch.Generator().manual_seed(budget)
    bonus, prefix = torch.randint(0, 40, (3,), generator=g), torch.randint(0, 100, (3,), generator=g)
    pool, req_to_token = torch.tensor([2, 0, 1]), torch.randperm(3 * 200, generator=g).view(3, 200)
    results = []
    for core in (rc17, rc18):
        trees = [core.build_ddtree_tree(logits[b], budget) for b in range(3)]
        batch = core.build_ddtree_batch(logits, budget)
        picks = walk_picks(batch, torch.Generator().manual_seed(7))
        ids, positions, slots = core.ddtree_verify_inputs(batch, bonus, prefix, pool, req_to_token)
        plan = core.ddtree_commit_plan(batch, picks, ids, prefix)
        results.append([
            trees, batch, core.tree_links(batch), core.tree_positions(batch, prefix),
            core.tree_attention_mask(trees[0], 5), core.follow_verified_tree_batch(batch, picks),
            (ids, positions, slots), plan,
            core.ddtree_kv_moves(path=plan.path, commit_lens=plan.commit_lens, slots=slots),
        ])
    assert int(results[0][1].num_nodes.sum()) > 0
    for name, a, b in zip(["trees", "batch", "links", "positions", "mask", "walk", "inputs", "plan", "moves"],
                          *results, strict=True):
        assert same(a, b), name


def test_no_module_of_the_newest_version_is_over_600_lines() -> None:
    newest = versions_in(OVERLAYS / "ddtree")[-1]
    overlay = load_overlay(f"ddtree@{newest}", OVERLAYS)
    sizes = {path: len(overlay.content_of(path, None).splitlines())
             for path in overlay.manifest.files if path.endswith(".py")}
    assert len(sizes) > 10 and max(sizes.values()) <= 600, sorted(sizes.items(), key=lambda kv: -kv[1])[:3]


def sibling_overlay(folder: Path, modules: dict[str, str]) -> None:
    """A one-version overlay ``sib@0.1.0`` (this test only) shipping the given modules by package path."""
    root = folder / "sib" / "0.1.0"
    for path, text in modules.items():
        (root / "files" / path).parent.mkdir(parents=True, exist_ok=True)
        (root / "files" / path).write_text(text)
    listed = "".join(f"  - {path}\n" for path in modules)
    (root / "overlay.yaml").write_text(f"name: sib\nversion: 0.1.0\ntarget: {{package: sglang, bases: ['0.5.17']}}\n"
                                       f"files:\n{listed}")


def test_the_loader_refuses_a_sibling_cycle_and_leaves_no_failed_module(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    tool = load_tool()
    monkeypatch.setattr(tool, "OVERLAYS", tmp_path)
    sibling_overlay(tmp_path, {
        "sglang/a.py": "from sglang.b import B\nA = 1\n",
        "sglang/b.py": "from sglang.a import A\nB = 2\n",
        "sglang/c.py": "from sglang.d import D\nC = D + 1\n",
        "sglang/d.py": "D = 1\n",
        "sglang/broken.py": "from sglang.d import D\nraise ValueError('no')\n",
    })
    with pytest.raises(ImportError, match=r"sib@0.1.0: circular sibling imports: a_0_1_0 -> b_0_1_0 -> a_0_1_0"):
        tool.load_overlay_module("sib@0.1.0", "sglang/a.py")
    with pytest.raises(ValueError, match="no"):
        tool.load_overlay_module("sib@0.1.0", "sglang/broken.py")
    assert not {"a_0_1_0", "b_0_1_0", "broken_0_1_0"} & set(sys.modules), "no half-loaded module stays"
    assert tool.load_overlay_module("sib@0.1.0", "sglang/c.py").C == 2
    assert "sglang.d" not in sys.modules and "d_0_1_0" in sys.modules
    for name in ("c_0_1_0", "d_0_1_0"):
        sys.modules.pop(name)
    tool.load_overlay_module.cache_clear()
