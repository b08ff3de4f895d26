"""What each overlay version ships: 0.2.2 is 0.2.1's round plus an attention-backend rule.

The CPU tests of 0.2.1's core and round (`dd021`) therefore cover 0.2.2; this test fails the day
0.2.2's copy of a file drifts from 0.2.1's without its own tests. The rule itself needs SGLang's
ServerArgs, so it is proven on the GPU (docs/gpu-validation.md, run 10).
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.ddtree.conftest import OVERLAY

SAME_AS_021 = ["sglang/srt/speculative/ddtree_utils.py", "sglang/srt/speculative/ddtree_worker_v2.py",
               "sglang/kernels/ops/speculative/ddtree.py"]


def files(version: str) -> Path:
    return OVERLAY / version / "files"


def test_022_ships_021s_round_byte_for_byte() -> None:
    for relative in SAME_AS_021:
        assert (files("0.2.2") / relative).read_bytes() == (files("0.2.1") / relative).read_bytes(), relative
    patches = sorted(p.relative_to(OVERLAY / "0.2.2") for p in (OVERLAY / "0.2.2" / "patches").rglob("*.diff"))
    assert patches and all((OVERLAY / "0.2.2" / p).read_bytes() == (OVERLAY / "0.2.1" / p).read_bytes()
                           for p in patches)


def test_022s_spec_only_adds_the_backend_rule() -> None:
    def names(version: str) -> set[str]:
        tree = ast.parse((files(version) / "sglang/srt/speculative/ddtree_spec.py").read_text())
        return {node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.ClassDef))}

    assert names("0.2.2") - names("0.2.1") == {"_use_a_tree_mask_backend", "_ddtree_default_backend"}
    assert names("0.2.1") <= names("0.2.2")
    source = (files("0.2.2") / "sglang/srt/speculative/ddtree_spec.py").read_text()
    assert 'DDTREE_VERIFY_BACKENDS = ("triton", "flashinfer")' in source and "fa3" not in source.split(
        "DDTREE_VERIFY_BACKENDS =")[1].split("\n")[0]
