"""Overlay ddtree's tree conv1d (``ddtree_conv1d_update``, 0.3.0-rc.12's bytes) against SGLang 0.5.17's own tree
mode of ``causal_conv1d_update``, both on the CPU through Triton's interpreter in a child process.

It handles every node of a tree at once where SGLang's kernel walks them in turn, so everything the
verify reads afterwards must be SGLang's bit for bit: the outputs, each node's conv window (what the
commit copies), the parents it derives from the links (what the GDN recurrence reads next) and the
rolled conv state; and a later layer, which reads the first layer's parents, must read them (a
later layer given wrong parents is told apart); and so must every tile config a bench may try (a
program walking its nodes a chunk of rows at a time, more or fewer channels and warps). The trees are DDTree's own (``build_ddtree_batch`` and ``tree_links``, one with
padding nodes), random deep ones, a padded batch row, float32 and float16 (the interpreter computes
bfloat16 wrongly for both kernels alike; the GPU run checks it). What it does not cover (a chain,
more than 512 nodes, mixed dtypes) must reach SGLang's kernel.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

from ddtree_deploy.pristine import pristine_release
from tests.ddtree.test_hybrid_links import trees
from tests.ddtree.triton_cpu import load_module, sglang_conv_kernel
from tests.overlay.plan_digests import BASE

RC = "ddtree@0.3.0-rc.12"
KERNEL = "sglang/kernels/ops/speculative/ddtree_conv1d.py"
SGLANG_KERNEL = "sglang/kernels/ops/mamba/causal_conv1d_triton.py"
BENCH = Path(__file__).resolve().parents[2] / "bench/conv1d_tree_verify.py"


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory, dd: ModuleType) -> dict[str, object]:
    from ddtree_deploy.catalog import load_overlay
    from tests.ddtree.conftest import OVERLAYS

    work = tmp_path_factory.mktemp("conv1d")
    (work / "ddtree_conv1d.py").write_bytes(load_overlay(RC, OVERLAYS).content_of(KERNEL, None))
    saved = {}
    for budget in (16, 64):
        tree = trees(dd, budget, 3, depth=5)  # the masked row (2 tokens a depth) has padding at 64
        _, next_token, next_sibling = dd.tree_links(tree)
        saved[budget] = {"next": next_token, "sib": next_sibling, "parents": tree.parents, "nodes": tree.num_nodes}
    torch.save(saved, work / "trees.pt")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(BENCH.parents[1])}
    child = subprocess.run([sys.executable, __file__, str(work), str(pristine_release(BASE) / SGLANG_KERNEL)], env=env,
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stdout + child.stderr[-4000:]
    return torch.load(work / "results.pt")


@pytest.mark.parametrize("budget", [16, 64])
def test_ddtree_trees_give_sglangs_results_bit_for_bit(results: dict[str, object], budget: int) -> None:
    got = results[f"ddtree{budget}"]
    assert got["equal"] == [True, True, True, True]  # outputs, conv state, windows, parents
    assert torch.equal(got["parents"], got["tree_parents"].clamp(min=0)), "the tree's own parents, padding at the root"


def test_the_masked_tree_has_padding_nodes(results: dict[str, object]) -> None:
    nodes = results["ddtree64"]["nodes"]
    assert int(nodes.min()) < 64 == int(nodes.max())


@pytest.mark.parametrize("case", ["random_fp32", "random_fp16", "deep_fp32", "one_request", "wide_fp32",
                                  "later_layer_fp32", "later_layer_fp16", "rows_of_8_fp32", "rows_of_16_later_fp16",
                                  "rows_of_4_deep_fp32"])
def test_random_trees_and_a_padded_row_give_sglangs_results(results: dict[str, object], case: str) -> None:
    equal, same = results[case]
    assert equal and same == 2


def test_a_planted_fault_is_seen(results: dict[str, object]) -> None:
    """The comparison can fail: a kernel whose every other window is off by one is told apart."""
    assert results["fault"] is False


def test_a_later_layer_reads_the_parents_it_is_given(results: dict[str, object]) -> None:
    """Given wrong parents (as if no earlier layer had written them), its results differ."""
    assert results["stale_parents"] is False


def test_a_server_takes_our_kernel_only_where_it_was_measured_faster(results: dict[str, object]) -> None:
    assert results["dispatch"] == {"33 nodes": "ours", "65 nodes": "ours", "128 nodes": "ours", "17 nodes": "ours",
                                   "17 nodes, 4 requests": "sglang", "129 nodes": "sglang", "chain": "sglang",
                                   "mixed dtypes": "sglang"}


@pytest.mark.parametrize(("requests", "dim", "nodes", "pays"), [
    (1, 512, 17, True),      # the copy hybrid at budget 16: 1.21x (run 26, H100; rc.11's rule left it out)
    (4, 512, 17, False),     # four requests: 1.11x, inside the 3 us spare
    (1, 512, 33, True),      # budget 32: 3.34x
    (4, 512, 33, True),      # 2.92x
    (4, 512, 65, True),      # budget 64: 5.13x
    (8, 512, 65, True),      # eight (--max-running-requests 8): the cost model, not measured
    (1, 10240, 17, False),   # one Qwen3.6-27B request at budget 16: 1.05x, inside the spare
    (1, 10240, 33, True),    # at 32: 1.83x
    (1, 10240, 65, True),    # at 64: 2.40x
    (2, 10240, 17, False),   # two at 16: 0.73x
    (2, 10240, 33, False),   # two at 32: 1.21x measured, the model's cost leaves it to SGLang's
    (2, 10240, 65, True),    # two at 64: between one (2.40x) and four (0.81x), not measured
    (4, 10240, 65, False),   # four at 64: 0.81x
    (4, 10240, 33, False),   # 0.68x
    (1, 512, 257, False),    # budget 256: not measured
])
def test_the_rule_follows_run_26(requests: int, dim: int, nodes: int, pays: bool) -> None:
    assert _rule()["tree_conv_pays"](requests, dim, nodes) is pays


@pytest.mark.parametrize(("requests", "dim", "nodes", "launch"), [
    (1, 10240, 65, (32, 16, 4)),   # 27B: 16 rows over 32 channels at every measured point
    (4, 10240, 17, (32, 16, 4)),
    (4, 512, 65, (16, 128, 4)),    # the copy hybrid: the whole tree over 16 channels (128 programs)
    (1, 512, 33, (16, 64, 4)),
    (1, 512, 17, (32, 16, 4)),     # 17 nodes: 16 rows over 32 channels
    (8, 512, 65, (32, 16, 4)),     # 256 narrow programs: too many
])
def test_the_launch_is_run_26s_fastest(requests: int, dim: int, nodes: int, launch: tuple[int, int, int]) -> None:
    assert _rule()["tile_config"](requests, dim, nodes) == launch


def _rule() -> dict[str, Any]:
    """The release's constants, ``tile_config`` and ``tree_conv_pays``, run without Triton."""
    from ddtree_deploy.catalog import load_overlay
    from tests.ddtree.conftest import OVERLAYS

    source = load_overlay(RC, OVERLAYS).content_of(KERNEL, None).decode()
    costs = source[source.index("OURS_US, "):source.index("\n\n", source.index("MAX_TREE_NODES = "))]
    rule = costs + "\n" + source[source.index("def tile_config"):source.index("def ddtree_conv1d_update")]
    namespace: dict[str, Any] = {"triton": SimpleNamespace(next_power_of_2=lambda n: 1 << (n - 1).bit_length(),
                                                           cdiv=lambda a, b: -(-a // b))}
    exec(rule, namespace)
    return namespace


def test_the_bench_sweeps_tile_configs_checked_against_sglang(results: dict[str, object]) -> None:
    assert results["sweep_status"] == 0
    header, *configs = results["sweep_lines"]
    assert header.startswith("small, 2 requests, tree of 13: SGLang ")
    assert [line.split(":")[0].strip() for line in configs] == ["8x4x2", "16x16x4"]
    assert not any("DIFFERENT" in line for line in configs)


def test_the_bench_checks_equality_in_the_interpreter(results: dict[str, object]) -> None:
    assert results["bench_status"] == 0
    lines = results["bench_lines"]
    assert len(lines) == 4 and all("equal to SGLang's; 2/2 replays the same" in line for line in lines)
    assert sum("parents ready" in line for line in lines) == 2


# --------------------------------------------------------------------------- the child process
def _ddtree_case(bench: ModuleType, sglang: ModuleType, ours: ModuleType, saved: dict) -> dict[str, object]:
    requests, width = saved["next"].shape
    case = bench.Case(40, requests, width, True, "cpu", torch.float32, seed=width)
    case.next_token, case.next_sibling = saved["next"].to(torch.int32), saved["sib"].to(torch.int32)
    theirs, mine = case.clone(), case.clone()
    want = theirs.results(theirs.call(sglang.causal_conv1d_update))
    got = mine.results(mine.call(ours.ddtree_conv1d_tree))
    return {"equal": [torch.equal(a, b) for a, b in zip(want, got, strict=True)], "parents": got[3],
            "tree_parents": saved["parents"].to(torch.int32), "nodes": saved["nodes"]}


def _later_layer_with_a_star(bench: ModuleType, sglang: Callable, ours: Callable) -> bool:
    """A later layer handed every node under the root instead of its tree: are the outputs SGLang's?"""
    case = bench.Case(24, 2, 17, True, "cpu", torch.float32, seed=3)
    theirs, mine = case.clone(), case.clone()
    want = theirs.call(sglang)
    mine.parents.zero_()
    return torch.equal(want, mine.call(functools.partial(ours, parents_ready=True)))


def _dispatch(bench: ModuleType, ours: ModuleType) -> dict[str, str]:
    reached: list[str] = []
    real = ours.causal_conv1d_update
    ours.causal_conv1d_update = lambda *a, **k: (reached.append("sglang"), real(*a, **k))[1]
    kernel = ours._ddtree_conv1d_tree_kernel
    ours._ddtree_conv1d_tree_kernel = type("Spy", (), {"__getitem__": lambda self, grid: (
        lambda *a, **k: (reached.append("ours"), kernel[grid](*a, **k)))})()
    found = {}
    for name, case in {
        "33 nodes": bench.Case(8, 2, 33, True, "cpu", torch.float32, 1),
        "65 nodes": bench.Case(8, 2, 65, True, "cpu", torch.float32, 1),
        "128 nodes": bench.Case(8, 1, 128, True, "cpu", torch.float32, 1),
        "17 nodes": bench.Case(8, 1, 17, True, "cpu", torch.float32, 1),
        "17 nodes, 4 requests": bench.Case(512, 4, 17, True, "cpu", torch.float32, 1),
        "129 nodes": bench.Case(8, 1, 129, True, "cpu", torch.float32, 1),
        "chain": bench.Case(8, 1, 9, False, "cpu", torch.float32, 1),
        "mixed dtypes": bench.Case(8, 1, 65, True, "cpu", torch.float32, 1),
    }.items():
        if name == "mixed dtypes":
            case.conv_state = case.conv_state.half()
            case.inter = case.inter.half()
        reached.clear()
        case.call(ours.ddtree_conv1d_update)
        found[name] = reached[-1]
    ours.causal_conv1d_update, ours._ddtree_conv1d_tree_kernel = real, kernel
    return found


def _run(work: Path, sglang_file: str) -> None:
    assert os.environ["TRITON_INTERPRET"] == "1"
    torch.set_num_threads(1)
    sglang = sglang_conv_kernel(sglang_file)
    bench = load_module(BENCH, "conv1d_tree_verify")
    ours = load_module(work / "ddtree_conv1d.py", "ddtree_conv1d")
    saved = torch.load(work / "trees.pt")
    theirs, mine = sglang.causal_conv1d_update, ours.ddtree_conv1d_tree
    results: dict[str, object] = {f"ddtree{b}": _ddtree_case(bench, sglang, ours, saved[b]) for b in (16, 64)}
    results.update({
        "random_fp32": bench.same_as_sglang(theirs, mine, 40, 3, 33, "cpu", torch.float32, 2),
        "random_fp16": bench.same_as_sglang(theirs, mine, 40, 3, 65, "cpu", torch.float16, 2),
        "deep_fp32": bench.same_as_sglang(theirs, mine, 24, 2, 20, "cpu", torch.float32, 2),
        "one_request": bench.same_as_sglang(theirs, mine, 24, 1, 9, "cpu", torch.float32, 2),
        "wide_fp32": bench.same_as_sglang(theirs, mine, 300, 2, 17, "cpu", torch.float32, 2),  # channel blocks
        "later_layer_fp32": bench.same_as_sglang(theirs, mine, 40, 3, 33, "cpu", torch.float32, 2, parents_ready=True),
        "later_layer_fp16": bench.same_as_sglang(theirs, mine, 300, 2, 65, "cpu", torch.float16, 2,
                                                 parents_ready=True),
        "rows_of_8_fp32": bench.same_as_sglang(theirs, functools.partial(mine, config=(8, 8, 2)), 40, 3, 33, "cpu",
                                               torch.float32, 2),
        "rows_of_16_later_fp16": bench.same_as_sglang(theirs, functools.partial(mine, config=(64, 16, 8)), 300, 2, 65,
                                                      "cpu", torch.float16, 2, parents_ready=True),
        "rows_of_4_deep_fp32": bench.same_as_sglang(theirs, functools.partial(mine, config=(16, 4, 4)), 24, 2, 20,
                                                    "cpu", torch.float32, 2),
    })

    def off_by_one(*args: object, **kwargs: object) -> torch.Tensor:
        out = mine(*args, **kwargs)
        kwargs["intermediate_conv_window"][:, ::2] += 1  # type: ignore[index]
        return out

    results["fault"] = bench.same_as_sglang(theirs, off_by_one, 24, 2, 17, "cpu", torch.float32, 0)[0]
    results["stale_parents"] = _later_layer_with_a_star(bench, theirs, mine)
    results["dispatch"] = _dispatch(bench, ours)
    import contextlib
    import io

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = bench.main(["--device", "cpu", "--ddtree-file", str(work / "ddtree_conv1d.py"), "--shapes", "small",
                             "--budgets", "8,12", "--requests", "2", "--equal", "2", "--no-timing"])
    results["bench_status"], results["bench_lines"] = status, printed.getvalue().splitlines()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = bench.main(["--device", "cpu", "--ddtree-file", str(work / "ddtree_conv1d.py"), "--shapes", "small",
                             "--budgets", "12", "--requests", "2", "--equal", "1", "--repeats", "1",
                             "--configs", "8x4x2,16x16x4"])
    results["sweep_status"], results["sweep_lines"] = status, printed.getvalue().splitlines()
    torch.save(results, work / "results.pt")


if __name__ == "__main__":
    _run(Path(sys.argv[1]), sys.argv[2])
