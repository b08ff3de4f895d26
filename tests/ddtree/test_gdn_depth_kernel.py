"""Overlay ddtree 0.3.0-rc.8's GatedDeltaNet tree verify (``ddtree_gdn_tree_verify``) against SGLang
0.5.17's own tree mode of ``fused_sigmoid_gating_delta_rule_update``, both on the CPU through Triton's
interpreter in a child process (as ``test_gdn_tree_kernel.py`` runs SGLang's).

rc.8 splits a tree into chains of first children and walks each in its own program, where SGLang
walks every node in turn: the per-node states it caches and the outputs it returns must be SGLang's
bit for bit. The trees are DDTree's own (``build_ddtree_batch``, parents as the hybrid backend
derives them from the links, so padding nodes hang off the root), a deep random tree, a request
without a state slot (a padded batch row), a state buffer in bfloat16, two value blocks a head,
rows shorter than the buffer (one of none, as a CUDA graph pads), and state rows other than the
requests' order. Parents that are not an earlier node (later, a cycle, out of range: never built)
must still return rather than wait forever. And a DDTREE
server's GDN backend must give a verify the depth kernel only at the shapes where run 22 measured it
faster than SGLang's, and SGLang's kernel elsewhere.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch

from ddtree_deploy.pristine import pristine_release
from tests.ddtree.test_hybrid_links import trees
from tests.ddtree.test_hybrid_rules import hybrid_module
from tests.ddtree.triton_cpu import load_module
from tests.overlay.plan_digests import BASE

RC8 = "ddtree@0.3.0-rc.8"
KERNEL = "sglang/kernels/ops/speculative/ddtree_gdn.py"
SGLANG_KERNEL = "sglang/kernels/ops/attention/fla/fused_sigmoid_gating_recurrent.py"
BENCH = Path(__file__).resolve().parents[2] / "bench/gdn_tree_verify.py"


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory, dd: ModuleType) -> dict[str, dict[str, torch.Tensor]]:
    from ddtree_deploy.catalog import load_overlay
    from tests.ddtree.conftest import OVERLAYS

    work = tmp_path_factory.mktemp("gdn")
    (work / "ddtree_gdn.py").write_bytes(load_overlay(RC8, OVERLAYS).content_of(KERNEL, None))
    tree = trees(dd, 16, 3, depth=3)  # the masked row (2 tokens a depth) has 14 nodes: 2 padding
    links = hybrid_module().ddtree_link_parents(tree.parents)
    torch.save({"ddtree": links, "nodes": tree.num_nodes}, work / "trees.pt")
    # The child imports this file, and so its imports of tests.*, from the repository root.
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(BENCH.parents[1])}
    sglang = pristine_release(BASE) / SGLANG_KERNEL
    child = subprocess.run([sys.executable, __file__, str(work), str(sglang)], env=env, capture_output=True,
                           text=True, timeout=300)  # about 20 s; a wait that never ends fails here
    assert child.returncode == 0, child.stderr[-4000:]
    return torch.load(work / "results.pt")


def test_the_ddtree_trees_branch_and_pad(results: dict[str, dict[str, torch.Tensor]]) -> None:
    nodes = results["ddtree"]["nodes"]
    assert int(nodes.min()) < 16 == int(nodes.max()), "one tree has padding nodes, one is full"
    parents = results["ddtree"]["parents"]
    assert all(len(set(row[1:].tolist())) < 16 for row in parents), "every tree branches"


@pytest.mark.parametrize("case", ["ddtree", "deep_random", "no_slot", "bf16_states", "two_value_blocks", "short_rows",
                                  "other_slots"])
def test_states_and_outputs_are_sglangs_bit_for_bit(results: dict[str, dict[str, torch.Tensor]], case: str) -> None:
    got = results[case]
    assert torch.equal(got["ours_states"], got["sglang_states"])
    rows = got["compared_rows"]
    assert torch.equal(got["ours_out"][0, rows], got["sglang_out"][0, rows])
    assert got["sglang_states"].abs().sum() > 0


def test_a_row_without_a_state_slot_caches_nothing(results: dict[str, dict[str, torch.Tensor]]) -> None:
    states = results["no_slot"]["ours_states"]
    assert (states[0] == 0).all() and (states[1] != 0).any()


def test_a_parent_that_is_not_an_earlier_node_returns(results: dict[str, dict[str, torch.Tensor]]) -> None:
    assert results["bad_parent"]["returned"].item() is True


def test_the_benchs_equality_check_passes_in_the_interpreter(tmp_path: Path) -> None:
    """``bench/gdn_tree_verify.py --equal``, the check the next GPU run makes first, on tiny shapes:
    both state dtypes, two budgets, each call repeated."""
    from ddtree_deploy.catalog import load_overlay
    from tests.ddtree.conftest import OVERLAYS

    kernel = tmp_path / "ddtree_gdn.py"
    kernel.write_bytes(load_overlay(RC8, OVERLAYS).content_of(KERNEL, None))
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    child = subprocess.run([sys.executable, str(BENCH), "--device", "cpu", "--small", "--budgets", "8,12", "--equal", "2",
                            "--kernel-file", str(pristine_release(BASE) / SGLANG_KERNEL), "--ddtree-kernel-file", str(kernel)],
                           env=env, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stdout + child.stderr[-3000:]
    lines = child.stdout.splitlines()
    assert len(lines) == 4 and all("equal to SGLang's; 2/2 replays the same" in line for line in lines)


# --------------------------------------------------------------------------- which kernel a verify gets
GDN_DDTREE = "sglang/srt/layers/attention/linear/kernels/gdn_ddtree.py"


@pytest.fixture(scope="module")
def dispatch(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    """rc.8's DDTreeGDNKernel over its real ddtree_gdn.py, with stand-ins (test only) for what needs a
    GPU: the depth kernel's launch and SGLang's TritonGDNKernel record which one a call reached."""
    from ddtree_deploy.catalog import load_overlay
    from tests.ddtree.conftest import OVERLAYS

    overlay = load_overlay(RC8, OVERLAYS)
    tmp = tmp_path_factory.mktemp("dispatch")
    calls: list[str] = []
    names = ["sglang.kernels.ops.speculative.ddtree_gdn", "sglang.srt.layers.attention.linear.kernels.gdn_triton"]
    with pytest.MonkeyPatch.context() as patch:  # the stand-in module names leave with the fixture
        for name in names:
            patch.setitem(sys.modules, name, ModuleType(name))  # recorded, so undone whatever replaces it
        (tmp / "ddtree_gdn.py").write_bytes(overlay.content_of(KERNEL, None))
        kernel = load_module(tmp / "ddtree_gdn.py", names[0])
        kernel.ddtree_gdn_tree_verify = lambda *args, **kwargs: calls.append("depth")
        serial = ModuleType(names[1])
        serial.TritonGDNKernel = type("TritonGDNKernel", (), {"target_verify": lambda self, *a, **k: calls.append("sglang")})
        sys.modules[names[1]] = serial
        namespace: dict[str, object] = {}
        exec(compile(overlay.content_of(GDN_DDTREE, None), GDN_DDTREE, "exec"), namespace)
        yield SimpleNamespace(kernel=kernel, verify_kernel=namespace["DDTreeGDNKernel"](), calls=calls)


@pytest.mark.parametrize(("requests", "value_heads", "value_dim", "width", "want"), [
    (1, 48, 128, 65, "depth"),     # Qwen3.6-27B, one request: 192 items, 1.7x faster (run 22)
    (4, 48, 128, 17, "sglang"),    # 768 items at budget 16: SGLang's was 1.45x faster
    (4, 48, 128, 65, "sglang"),    # and 1.07x at 64
    (4, 48, 128, 257, "depth"),    # and 1.2x slower at 256
    (4, 4, 64, 65, "depth"),       # the copy hybrid, 32 items
])
def test_a_tree_verify_runs_in_depth_steps_where_run_22_measured_them_faster(
    dispatch: SimpleNamespace, requests: int, value_heads: int, value_dim: int, width: int, want: str
) -> None:
    v = torch.empty((1, requests * width, value_heads, value_dim))
    dispatch.calls.clear()
    dispatch.verify_kernel.target_verify(
        None, None, None, None, v, None, None, ssm_states=None, cache_indices=None,
        query_start_loc=torch.arange(0, requests * width + 1, width),
        intermediate_states_buffer=torch.empty((requests, width, 1)), intermediate_state_indices=None,
        cache_steps=width, retrieve_parent_token=None)
    assert dispatch.calls == [want]


def test_items_are_sglangs_value_blocks(dispatch: SimpleNamespace) -> None:
    assert dispatch.kernel.verify_items(1, 48, 128) == 192  # 32-wide value blocks
    assert dispatch.kernel.verify_items(4, 4, 64) == 32
    assert dispatch.kernel.verify_items(2, 3, 16) == 6  # a head narrower than a block is one block


# --------------------------------------------------------------------------- the child process
def _both(bench: ModuleType, sglang: object, ours: ModuleType, parents: torch.Tensor, state_dtype: torch.dtype,
          slots: list[int], seed: int, *, lengths: list[int] | None = None, start_slots: list[int] | None = None,
          head_dim: int = 16) -> dict[str, torch.Tensor]:
    """One verify of ``parents`` ([requests, width]) by SGLang's kernel and by rc.8's, same inputs.
    ``slots`` are the rows of the per-node state buffer (-1: none), ``start_slots`` those of the
    committed states (default: the requests in order), ``lengths`` the tokens each request verifies
    (default: the width; a CUDA graph's padded requests verify none)."""
    requests, width = parents.shape
    lengths = lengths or [width] * requests
    shapes = bench.Shapes(requests=requests, key_heads=1, value_heads=2, head_dim=head_dim, layers=1, chain=8)
    x = bench.inputs(shapes, width, "cpu", torch.float32, torch.Generator().manual_seed(seed))
    links = parents.to(torch.int32).clamp(min=0)
    indices = torch.tensor(slots, dtype=torch.int32)
    starts = torch.tensor(start_slots if start_slots is not None else list(range(requests)), dtype=torch.int32)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    out: dict[str, torch.Tensor] = {}
    for name in ("sglang", "ours"):
        states = torch.zeros((max(slots) + 1, width, 2, head_dim, head_dim), dtype=state_dtype)
        if name == "sglang":
            o = sglang(A_log=x["A_log"], dt_bias=x["dt_bias"], q=x["q"], k=x["k"], v=x["v"], a=x["a"], b=x["b"],
                       initial_state_source=x["ssm_states"], initial_state_indices=starts, cu_seqlens=cu_seqlens,
                       use_qk_l2norm_in_kernel=True, softplus_beta=1.0, softplus_threshold=20.0, is_kda=False,
                       disable_state_update=True, intermediate_states_buffer=states,
                       intermediate_state_indices=indices, cache_steps=width, retrieve_parent_token=links)
        else:
            o = ours.ddtree_gdn_tree_verify(
                x["A_log"], x["a"], x["dt_bias"], x["q"], x["k"], x["v"], x["b"],
                initial_state_source=x["ssm_states"], initial_state_indices=starts, cu_seqlens=cu_seqlens,
                intermediate_states_buffer=states, intermediate_state_indices=indices, retrieve_parent_token=links)
        out[f"{name}_states"], out[f"{name}_out"] = states, o
    # A row without a slot is padding: SGLang runs it as a chain, rc.8 as the tree; neither is read.
    rows = torch.zeros(o.shape[1], dtype=torch.bool)
    for slot, start, length in zip(slots, cu_seqlens.tolist(), lengths, strict=False):
        rows[start : start + length] = slot >= 0
    out["compared_rows"] = rows
    return out


def _run(work: Path, sglang_file: Path) -> None:
    assert os.environ["TRITON_INTERPRET"] == "1"
    torch.set_num_threads(1)
    bench = load_module(BENCH, "gdn_tree_verify")
    sglang = bench.load_kernel(str(sglang_file))
    ours = load_module(work / "ddtree_gdn.py", "rc8_ddtree_gdn")
    saved = torch.load(work / "trees.pt")
    ddtree = saved["ddtree"]
    g = torch.Generator().manual_seed(5)
    deep = torch.tensor([bench.random_parents(33, 15, g) for _ in range(2)])
    bad = torch.tensor([[-1, 0, 3, 1, 2, 0], [-1, 0, 4, 0, 2, 2], [-1, 99, 0, -7, 1, 1]])  # later, a cycle, out of range
    results = {
        "ddtree": {**_both(bench, sglang, ours, ddtree, torch.float32, [0, 1, 2, 3], 1), "nodes": saved["nodes"],
                   "parents": ddtree},
        "deep_random": _both(bench, sglang, ours, deep, torch.float32, [0, 1], 2),
        "no_slot": _both(bench, sglang, ours, deep, torch.float32, [-1, 1], 3),
        "bf16_states": _both(bench, sglang, ours, ddtree[:2], torch.bfloat16, [0, 1], 4),
        "two_value_blocks": _both(bench, sglang, ours, ddtree[:2], torch.float32, [0, 1], 7, head_dim=64),
        "short_rows": _both(bench, sglang, ours, ddtree, torch.float32, [0, 1, 2, 3], 8, lengths=[17, 9, 0, 17]),
        "other_slots": _both(bench, sglang, ours, ddtree[:2], torch.float32, [2, 0], 9, start_slots=[1, 0]),
    }
    # rc.8's kernel alone: SGLang's reads the state of parent 99 from outside its buffer.
    x = bench.inputs(bench.Shapes(requests=3, key_heads=1, value_heads=2, head_dim=16, layers=1, chain=8), 6, "cpu",
                     torch.float32, torch.Generator().manual_seed(6))
    slots = torch.arange(3, dtype=torch.int32)
    ours.ddtree_gdn_tree_verify(
        x["A_log"], x["a"], x["dt_bias"], x["q"], x["k"], x["v"], x["b"], initial_state_source=x["ssm_states"],
        initial_state_indices=slots, cu_seqlens=torch.arange(0, 19, 6, dtype=torch.int32),
        intermediate_states_buffer=torch.zeros((3, 6, 2, 16, 16)), intermediate_state_indices=slots,
        retrieve_parent_token=bad.to(torch.int32))
    results["bad_parent"] = {"returned": torch.tensor(True)}
    torch.save(results, work / "results.pt")


if __name__ == "__main__":
    _run(Path(sys.argv[1]), Path(sys.argv[2]))
