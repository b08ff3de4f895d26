"""Overlay ddtree 0.3.0-rc.36's and rc.37's programmatic dependent launch, in the PTX an H100 or H200 runs: each
kernel of the tree build, compiled here for sm_90 with Triton's own backend (no GPU needed), waits for the launch
before it (``griddepcontrol.wait``) before its first load, store or atomic of global memory; rc.36's then lets the
next launch start (``griddepcontrol.launch_dependents``), rc.37's and rc.39's do not (the next starts as its programs
exit); without USE_GDC neither instruction is there. A read before the wait would see the previous kernel's memory
half written, a race no interpreter test can show. The launches' options are ``test_tree_build_triton``'s to check.

The kernels compile in a child process, so that the stand-in ``sglang`` modules they import stay out of this one.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

# Each version, and whether its kernels let the next launch start early.
SPECS = {"ddtree@0.3.0-rc.36": True, "ddtree@0.3.0-rc.37": False, "ddtree@0.3.0-rc.39": False}
KERNELS = "sglang/kernels/ops/speculative"
MODULES = ("ddtree_launch", "ddtree_top_k", "ddtree_build")  # the launch module first: the others import it
# The build's kernels (module, attribute, constexprs, warps) with a server's constexprs at budget 512, batch 1:
# 2,048-entry chunks of 151,936 entries (75 chunks), k = 512 (CAP 1,024), three phases of the pop loop's frontier, 8
# visibility rows a program; then the log-probs' two as they run alone. (No alignment hints or register cap: neither
# moves the wait.)
LAUNCHES = {
    "lse": ("ddtree_top_k", "_ddtree_lse_parts_kernel", {"BLOCK": 2048, "STATE": 2048}, 4),
    "log_probs": ("ddtree_top_k", "_ddtree_log_probs_kernel", {"BLOCK": 2048, "CP2": 128, "TOP_K_BITS": 8}, 4),
    **{f"count {step}": ("ddtree_top_k", "_ddtree_radix_count_kernel",
                         {"PASS": step, "BLOCK": 2048, "BITS": 8, "CAP": 1024 if step < 3 else 0}, 4)
       for step in (1, 2, 3)},
    "split": ("ddtree_top_k", "_ddtree_split_ids_kernel", {"BLOCK": 2048, "CP2": 128, "BITS": 8}, 4),
    "order": ("ddtree_top_k", "_ddtree_top_k_order_kernel", {"BITS": 8, "CAP": 1024}, 8),
    "pop": ("ddtree_build", "_ddtree_build_kernel",
            {"FIRST_SLOTS": 128, "PHASES": 3, "SLOT_BITS": 16, "DEPTH_BITS": 8, "ONE_REDUCTION": True}, 4),
    "visibility": ("ddtree_build", "_ddtree_visibility_kernel", {"ROWS": 8, "COLS": 1024}, 4),
    "lse alone": ("ddtree_top_k", "_ddtree_lse_parts_kernel", {"BLOCK": 2048, "STATE": 0}, 4),
    "log_probs alone": ("ddtree_top_k", "_ddtree_log_probs_kernel", {"BLOCK": 2048, "CP2": 128, "TOP_K_BITS": 0}, 4),
}
POINTERS = {"logits_ptr": "*bf16", "parts_ptr": "*fp64", "radix_ptr": "*i32", "log_probs_ptr": "*fp32",
            "ordered_ptr": "*i32", "suffix_ptr": "*i32", "above_ptr": "*i32", "keys_ptr": "*i64", "tokens_ptr": "*i64",
            "out_log_probs_ptr": "*fp32", "out_tokens_ptr": "*i64", "top_tokens_ptr": "*i64", "depths_ptr": "*i64",
            "parents_ptr": "*i64", "scores_ptr": "*fp64", "num_nodes_ptr": "*i64", "visibility_ptr": "*u8"}
# A PTX instruction (after any predicate) that reads or writes memory; those in the state spaces no other launch
# writes (a kernel's parameters, its shared and local memory, constants) do not count.
MEMORY_ACCESS = re.compile(r"^\s*(?:@!?%\w+\s+)?((?:ld|st|atom|red|cp|prefetch|mbarrier)\.[\w.:]*)", re.MULTILINE)
OWN_SPACES = (".param", ".shared", ".local", ".const")


@pytest.mark.parametrize("spec", SPECS)
def test_every_build_kernel_waits_before_it_touches_memory(tmp_path: Path, spec: str) -> None:
    from ddtree_deploy.catalog import load_overlay
    from tests.ddtree.conftest import OVERLAYS

    overlay = load_overlay(spec, OVERLAYS)
    for module in MODULES:
        (tmp_path / f"{module}.py").write_bytes(overlay.content_of(f"{KERNELS}/{module}.py", None))
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # not the user's ~/.triton
    child = subprocess.run([sys.executable, __file__, str(tmp_path)], env=env, capture_output=True, text=True,
                           timeout=600)
    assert child.returncode == 0, child.stderr[-4000:]
    found = json.loads(child.stdout)
    assert sorted(found["on"]) == sorted(LAUNCHES)
    assert found["kernels"] == dict.fromkeys(sorted({attribute for _, attribute, _, _ in LAUNCHES.values()}), True)
    for label, places in found["on"].items():
        assert -1 < places["wait"] < places["memory"], (label, places)
        assert (places["launch"] > -1) == SPECS[spec], (label, places)
    for label, places in found["off"].items():
        assert places["wait"] == places["launch"] == -1 < places["memory"], (label, places)


# --------------------------------------------------------------------------- the child process
def _places(ptx: str) -> dict[str, int]:
    """Where the wait, the next launch's start and the first access to memory another launch may write stand."""
    memory = [match.start(1) for match in MEMORY_ACCESS.finditer(ptx) if not any(
        space in match.group(1) for space in OWN_SPACES)]
    return {"wait": ptx.find("griddepcontrol.wait"), "launch": ptx.find("griddepcontrol.launch_dependents"),
            "memory": min(memory, default=-1)}


def _ptx(kernel: Any, constants: dict[str, Any], warps: int) -> str:
    from tests.ddtree.triton_cpu import hopper_ptx

    signature = {name: "constexpr" if name in constants else POINTERS.get(name, "i32") for name in kernel.arg_names}
    return hopper_ptx(kernel, signature, constants, warps)


def _compile_all(work: Path) -> None:
    """Where the wait, the launch of the next and the first global memory access stand in every build kernel's PTX
    with USE_GDC, and in one without; and whether each kernel of the two modules takes USE_GDC."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: tests.ddtree's helpers
    from tests.ddtree.triton_cpu import load_module, stand_in_pdl_check

    stand_in_pdl_check()
    modules = {name: load_module(work / f"{name}.py", f"sglang.kernels.ops.speculative.{name}") for name in MODULES}
    kernels = {attribute: "USE_GDC" in value.arg_names for name in ("ddtree_top_k", "ddtree_build")
               for attribute, value in sorted(vars(modules[name]).items()) if attribute.endswith("_kernel")}
    on = {label: _places(_ptx(getattr(modules[module], attribute), {**constants, "USE_GDC": True}, warps))
          for label, (module, attribute, constants, warps) in LAUNCHES.items()}
    module, attribute, constants, warps = LAUNCHES["visibility"]
    off = {"visibility": _places(_ptx(getattr(modules[module], attribute), {**constants, "USE_GDC": False}, warps))}
    print(json.dumps({"kernels": kernels, "on": on, "off": off}))


if __name__ == "__main__":
    _compile_all(Path(sys.argv[1]))
