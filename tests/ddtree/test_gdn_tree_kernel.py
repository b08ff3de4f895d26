"""SGLang 0.5.17's GatedDeltaNet verify kernel in tree mode, the one a DDTREE verify on a hybrid target
runs, on the CPU through Triton's interpreter (a child process, as ``test_tree_build_triton.py``
runs the tree builder), driven by ``bench/gdn_tree_verify.py``'s own check.

Every node's cached state must be the float32 delta rule along the node's own path (root first),
on a random tree whose parents come before their children as DDTree's pop order gives them, and on
a chain (DFLASH's verify). The check must also fail: the kernel handed the chain's parents while
the reference follows the tree.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddtree_deploy.pristine import pristine_release
from tests.overlay.plan_digests import BASE

BENCH = Path(__file__).resolve().parents[2] / "bench/gdn_tree_verify.py"
KERNEL = "sglang/kernels/ops/attention/fla/fused_sigmoid_gating_recurrent.py"
CHILD = """
import importlib.util, json, sys, torch
spec = importlib.util.spec_from_file_location("gdn_tree_verify", sys.argv[1])
bench = importlib.util.module_from_spec(spec); sys.modules[spec.name] = bench; spec.loader.exec_module(bench)
kernel = bench.load_kernel(sys.argv[2])
shapes = bench.SMALL
tree = bench.random_parents(13, shapes.chain - 1, torch.Generator().manual_seed(4))
chain = list(range(-1, 12))
print(json.dumps({
    "tree": bench.state_error(kernel, shapes, 13, tree, "cpu", torch.float32, 2),
    "chain": bench.state_error(kernel, shapes, 8, None, "cpu", torch.float32, 3),
    "fault": bench.state_error(kernel, shapes, 13, tree, "cpu", torch.float32, 2, kernel_parents=chain),
    "branching": len(tree) - len(set(tree)),
}))
"""


@pytest.fixture(scope="module")
def errors() -> dict[str, float]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    kernel = pristine_release(BASE) / KERNEL
    child = subprocess.run([sys.executable, "-c", CHILD, str(BENCH), str(kernel)], env=env,
                           capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-4000:]
    return json.loads(child.stdout.strip().splitlines()[-1])


def test_every_node_state_is_the_recurrence_along_its_path(errors: dict[str, float]) -> None:
    assert errors["branching"] > 0, "the tree should branch somewhere"
    assert errors["tree"] < 1e-5
    assert errors["chain"] < 1e-5


def test_the_check_catches_wrong_parents(errors: dict[str, float]) -> None:
    assert errors["fault"] > 1e-2
