"""Overlay ddtree 0.3.0-rc.3's fused Triton tree builder (``ddtree_build.py``) against the torch batch
builder and the reference heap, on the CPU through Triton's interpreter (numpy, float64 as on the GPU);
and rc.16's (the same pop loop, its launcher taking a warp count, after rc.16's 32-bit top-K), rc.18's
(rc.16's code with the core split in three modules: the dispatch is looked up in the tree's and builder's),
rc.19's (two pops per reduction of the frontier, and a radix-select top-K), rc.20's (the log-probs
by Triton kernels: a float64 logsumexp over chunks of each row), rc.21's (the tokens gathered after the
pop loop; the log-probs and top-K kernels in a module of their own), rc.22's (the top-K from the logits,
in seven launches), rc.23's (the frontier in int32 words: a key of position over slot, a payload),
rc.24's (the log-prob table read into L1 before the pop loop), rc.25's (the radix select's cut picked
once per pass by the row's last program, histograms skipped where no entry is in the running) and
rc.26's (the radix pick's barrier the kernel's own, the cut passed to the pick; the interpreter runs
one program at a time, so the ordering the barrier keeps can only show on a GPU), rc.27's (the pop
loop's frontier in phases of doubling width: the budgets above 128 run two phases or more), rc.28's
(a top-K row finished from its candidates after two passes when they are few, which the small
vocabularies here mostly take and flat rows do not; the second pop's log-probs read beside the first's),
rc.29's (a flagged row's candidates collected by the third pass's launch), rc.30's (the visibility
written as zeros, then a byte per ancestor; like rc.26's, the barrier that orders those stores, and the
one in its tokens pass, can only show on a GPU), rc.31's (each row sorted by the last program through
the split's launch, whose counter the interpreter's one program at a time counts as a GPU does) and
rc.32's (rc.31's edit undone, the sort's warps by its width, which the interpreter does not model).

The interpreter is chosen when a kernel is decorated (``TRITON_INTERPRET=1`` before triton is
imported), so a version's kernels run in a child process started with that variable: nothing of it reaches
this process or other tests, whatever order pytest runs them in. The children of the versions run as many at once
as this process may use CPUs, while the tests read the trees of those done. A child builds every case through
the version's own ``build_ddtree_batch`` with its CUDA dispatch pointed at the interpreted kernels (the path
the GPU takes, top-K included) and hands the trees back; the comparisons run here.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any
from unittest import mock

import pytest
import torch

SPECS = ["ddtree@0.3.0-rc.3", "ddtree@0.3.0-rc.16", "ddtree@0.3.0-rc.18", "ddtree@0.3.0-rc.19", "ddtree@0.3.0-rc.20",
         "ddtree@0.3.0-rc.21", "ddtree@0.3.0-rc.22", "ddtree@0.3.0-rc.23", "ddtree@0.3.0-rc.24",
         "ddtree@0.3.0-rc.25", "ddtree@0.3.0-rc.26", "ddtree@0.3.0-rc.27", "ddtree@0.3.0-rc.28",
         "ddtree@0.3.0-rc.29", "ddtree@0.3.0-rc.30", "ddtree@0.3.0-rc.31", "ddtree@0.3.0-rc.32",
         "ddtree@0.3.0-rc.33", "ddtree@0.3.0-rc.34", "ddtree@0.3.0-rc.35", "ddtree@0.3.0-rc.36",
         "ddtree@0.3.0-rc.37", "ddtree@0.3.0-rc.39"]
# The launcher's bound on the budget: the int64 key's 16-bit fields, from rc.23 the int32 key's positions.
MAX_BUDGET = {spec: 1 << 15 for spec in SPECS[SPECS.index("ddtree@0.3.0-rc.23"):]}
# The versions whose Triton top-K takes the logits (makes its own images) rather than the log-probs kernels'.
TOP_K_FROM_LOGITS = set(SPECS[SPECS.index("ddtree@0.3.0-rc.22"):])
# The versions whose top-K finishes a row from its candidates after two passes when they are few.
TOP_K_CANDIDATES = set(SPECS[SPECS.index("ddtree@0.3.0-rc.28"):])
# The versions whose order kernel's warps grow with its sort's width (rc.32 on; rc.31 sorted in the split's launch).
ORDER_WARPS = set(SPECS[SPECS.index("ddtree@0.3.0-rc.32"):])
# The versions whose vocabulary chunk follows the grid (rc.33 on: 2,048 entries where 4,096 give too few programs).
CHUNK_BY_GRID = set(SPECS[SPECS.index("ddtree@0.3.0-rc.33"):])
# The versions whose launches over the vocabulary run under a register cap by their chunk (rc.34 on).
REGISTER_CAPS = set(SPECS[SPECS.index("ddtree@0.3.0-rc.34"):])
# The versions whose build launches wait on the one before where the GPU takes it (rc.36 on: programmatic dependent
# launch), and those whose answer is no under Triton's interpreter whatever the device (rc.37 on).
DEPENDENT_LAUNCH = set(SPECS[SPECS.index("ddtree@0.3.0-rc.36"):])
NO_PDL_UNDER_INTERPRETER = set(SPECS[SPECS.index("ddtree@0.3.0-rc.37"):])
CHUNK_RULE_ROWS = (15, 27, 28, 120, 138, 139)  # each side of both versions' last row count for 2,048-entry chunks
KERNEL = "sglang/kernels/ops/speculative/ddtree_build.py"
TOP_K_KERNEL = "sglang/kernels/ops/speculative/ddtree_top_k.py"  # rc.21 on: the log-probs and top-K kernels
LAUNCH = "sglang/kernels/ops/speculative/ddtree_launch.py"  # rc.36 on: the build launches' options
UTILS = "sglang/srt/speculative/ddtree_utils.py"
# rc.18 on: the core in three modules, loaded in this order (utils re-exports the builders)
CORE = ["sglang/srt/speculative/ddtree_tree.py", "sglang/srt/speculative/ddtree_builder.py", UTILS]
FIELDS = ("tokens", "depths", "parents", "visibility", "scores", "num_nodes")
FAMILIES = ["sharp", "flat", "bf16", "integer", "masked"]

# (family, bs, L, V, budgets): every tie-heavy family of conftest.py; the interpreter takes a few ms
# per popped node, so a version's child takes minutes of one CPU (below).
CASES = [(family, 2, 7, 60, [1, 5, 16, 64, 150]) for family in FAMILIES] + [
    ("integer", 1, 15, 40, [512, 1024]),  # the serving budgets, on a tie-heavy small vocabulary
    ("bf16", 1, 15, 48, [512]),
    ("integer", 2, 5, 6, [16, 32]),  # small trees full of exact ties between different parents' children
    ("integer", 2, 4, 3, [2, 120, 200]),  # K = V = 3 < budget; 200 > the whole 3-ary tree (120 nodes)
    ("flat", 2, 1, 50, [10, 50, 80]),  # L = 1
    ("integer", 1, 255, 3, [300]),  # depth 255, the widest the key (rc.23: the payload) holds
    # rc.27's phases: one node past the first phase's width (129) and the widths' edges (256, 257)
    ("sharp", 2, 7, 60, [129, 257]),
    ("masked", 2, 7, 60, [256]),
]
MINUS_INF_BUDGETS = [1, 3, 40]
# Trials of test_tree_build's engineered_rounding_logits whose heap scores at budget 400 hang on float64
# roundings of the sibling fold (where the torch builder's one replay pass gives up).
ROUNDING_TRIALS = [1, 7, 10]
ROUNDING_BUDGET = 400
NAMES = (
    [f"{f}-bs{bs}-L{length}-V{v}-B{b}" for f, bs, length, v, budgets in CASES for b in budgets]
    + [f"minus-inf-rows-B{b}" for b in MINUS_INF_BUDGETS]
    + [f"rounding-{trial}-B{ROUNDING_BUDGET}" for trial in ROUNDING_TRIALS]
)
# The interpreter runs the GPU's one-reduction pop element by element: small trees only.
ONE_REDUCTION = [n for n in NAMES if int(n.rsplit("-B", 1)[1]) <= 32]
MakeLogits = Callable[[str, tuple[int, ...], int], torch.Tensor]
# A version's child takes about 4 minutes of one CPU on a slow host (an AMD EPYC, 2026-12-07); two of them beside the
# tests may take half as long again. A test waits for its version's child in its fixture, so each test here may take
# as long as a child may (scripts/test.sh gives pytest's tests 600 s each).
CHILD_SECONDS = 1500
pytestmark = pytest.mark.timeout(CHILD_SECONDS)


def minus_inf_rows() -> torch.Tensor:
    """Request 0: depth 2 fully masked (log_softmax gives NaN there), so its tree stops at depth 1;
    request 1: depth 1 fully masked, a root-only tree; request 2: one finite token per depth, a chain."""
    logits = torch.randn(3, 4, 16, generator=torch.Generator().manual_seed(5))
    logits[0, 1] = float("-inf")
    logits[1, 0] = float("-inf")
    logits[2] = float("-inf")
    logits[2, :, 3] = 1.0
    return logits


def all_cases(make_logits: MakeLogits) -> dict[str, tuple[torch.Tensor, int]]:
    """NAMES -> (logits [bs, L, V], budget)."""
    from tests.ddtree.test_tree_build import engineered_rounding_logits

    logits = [make_logits(f, (bs, length, v), length * 1000 + v) for f, bs, length, v, budgets in CASES for _ in budgets]
    budgets = [b for *_, case_budgets in CASES for b in case_budgets]
    logits += [minus_inf_rows()] * len(MINUS_INF_BUDGETS)
    budgets += MINUS_INF_BUDGETS
    rng = torch.Generator().manual_seed(0)  # the seed of test_tree_build's rounding tests
    rounding = [engineered_rounding_logits(rng)[None] for _ in range(max(ROUNDING_TRIALS) + 1)]
    logits += [rounding[trial] for trial in ROUNDING_TRIALS]
    budgets += [ROUNDING_BUDGET] * len(ROUNDING_TRIALS)
    return dict(zip(NAMES, zip(logits, budgets, strict=True), strict=True))


@pytest.fixture(scope="module", params=SPECS)
def spec(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def core(decode_tool: ModuleType, spec: str) -> ModuleType:
    """The version's ddtree_utils.py (its torch builder: what the kernels must equal)."""
    return decode_tool.load_overlay_module(spec, UTILS)


def private(core: ModuleType, name: str) -> Any:
    """A private name of the version's core: ddtree_utils.py's own or, in a split core (rc.18 on), that of
    the module defining it (the tree's or the builder's), reached through a public function's globals."""
    for scope in (vars(core), core.build_ddtree_tree.__globals__, core.build_ddtree_batch.__globals__):
        if name in scope:
            return scope[name]
    raise AttributeError(name)


@pytest.fixture(scope="module")
def cases(make_logits: MakeLogits) -> dict[str, tuple[torch.Tensor, int]]:
    return all_cases(make_logits)


@pytest.fixture(scope="module")
def children(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
             cases: dict[str, tuple[torch.Tensor, int]], make_logits: MakeLogits) -> Iterator[dict[str, Future[dict]]]:
    """Every selected version's cases built by its interpreted kernels, one child process a version, as many at once
    as this process may use CPUs (a child runs one thread), in SPECS order: later versions' children run while the
    tests read the earlier ones' trees. When the module ends, those not started never start and those running are
    killed."""
    selected = {item.callspec.params["spec"] for item in request.session.items
                if getattr(item, "module", None) is request.module and "from_kernels" in item.fixturenames}
    works = {spec: _child_work(tmp_path_factory.mktemp("triton"), spec, cases, make_logits)
             for spec in SPECS if spec in selected}
    started: list[subprocess.Popen[str]] = []
    stopping = threading.Event()
    pool = ThreadPoolExecutor(max_workers=max(1, min(len(works), _usable_cpus())))
    try:
        yield {spec: pool.submit(_run_child, work, started, stopping) for spec, work in works.items()}
    finally:
        stopping.set()
        pool.shutdown(wait=False, cancel_futures=True)
        for child in list(started):
            child.kill()
        pool.shutdown(wait=True)


@pytest.fixture(scope="module")
def from_kernels(children: dict[str, Future[dict]], spec: str) -> dict[str, dict]:
    """Every case built by the version's interpreted kernels; also the launcher's refusals."""
    return children[spec].result()


def _usable_cpus() -> int:
    """The CPUs this process may run on (its affinity, as nproc counts them; the machine's where none is known)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _child_work(work: Path, spec: str, cases: dict[str, tuple[torch.Tensor, int]], make_logits: MakeLogits) -> Path:
    """``work`` holding what the version's child reads: its kernel and core files, and the cases."""
    from ddtree_deploy.catalog import load_overlay
    from tests.ddtree.conftest import OVERLAYS

    overlay = load_overlay(spec, OVERLAYS)
    for path in (KERNEL, TOP_K_KERNEL, LAUNCH, *CORE):  # the interpreter reads a kernel's source from its file
        if path in overlay.manifest.files:
            (work / Path(path).name).write_bytes(overlay.content_of(path, None))
    torch.save({**cases, "top_k": top_k_cases(make_logits)}, work / "cases.pt")
    return work


def _run_child(work: Path, started: list[subprocess.Popen[str]], stopping: threading.Event) -> dict[str, dict]:
    """The trees a child builds in ``work`` (it is added to ``started``, so that teardown can kill it; one started
    as teardown begins kills itself)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen([sys.executable, __file__, str(work)], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    started.append(child)
    if stopping.is_set():
        child.kill()
    try:
        _, stderr = child.communicate(timeout=CHILD_SECONDS)
    except subprocess.TimeoutExpired:
        child.kill()
        raise
    assert child.returncode == 0, stderr[-4000:]
    return torch.load(work / "trees.pt")


def top_k_cases(make_logits: MakeLogits) -> dict[str, tuple[torch.Tensor, int]]:
    """Rows longer than the kernels' 4,096-entry chunks, tie-heavy; a fully masked (NaN) row, a row whose
    first chunk is all masked, and a row with a +inf logit (NaN log-probs); and rows of near-ties: 600
    float32 logits within 700 units in the last place, over three chunks, so the k-th image shares its
    high 24 bits with entries of other low bytes in earlier chunks (rc.22's split counts those from
    the last pass's suffix sums; bf16 logits never get there); and rows of one finite logit, whose only
    candidate sits exactly on rc.28's 16-bit cut."""
    masked = make_logits("bf16", (2, 3, 9000), 3).float()
    masked[1, 2] = float("-inf")
    masked[0, 1, :4096] = float("-inf")
    masked[1, 0, 17] = float("inf")
    seeded = torch.Generator().manual_seed(0)
    near_ties = torch.full((1, 2, 9000), -30.0)
    ulps = torch.randint(0, 700, (1, 2, 600), generator=seeded)
    near_ties.scatter_(-1, torch.randint(0, 9000, (1, 2, 600), generator=seeded), 1.0 + ulps * 2.0**-23)
    one_finite = torch.full((1, 2, 16), float("-inf"))
    one_finite[0, :, 3] = 1.0  # log-prob 0.0: an image whose low 16 bits are zero, at the cut itself
    return {"bf16-k7": (make_logits("bf16", (2, 3, 9000), 1), 7), "integer-k60": (make_logits("integer", (1, 4, 8200), 2), 60),
            "masked-k33": (masked, 33), "near-ties-k200": (near_ties, 200), "one-finite-k1": (one_finite, 1)}


def test_the_triton_top_k_is_the_int64_key_top_k(core: ModuleType, spec: str, from_kernels: dict,
                                                 make_logits: MakeLogits) -> None:
    """The version's interpreted top-K kernels (rc.16's repaired select, rc.19's radix select) give the
    int64 key's log-probs and tokens bit for bit (rc.3's top-K is the int64 key itself: it has no kernels
    for it)."""
    if spec == "ddtree@0.3.0-rc.3":
        assert not hasattr(core, "_ddtree_key64_tokens") and not any(key.startswith("top_k/") for key in from_kernels)
        return
    for name, (logits, k) in top_k_cases(make_logits).items():
        assert_the_key_top_k(core, from_kernels[f"top_k/{name}"], logits, k, name)


def assert_the_key_top_k(core: ModuleType, got: tuple[torch.Tensor, torch.Tensor], logits: torch.Tensor, k: int,
                         name: str) -> None:
    """``got`` (log-probs, tokens) is the int64 key's top-K of ``logits``, bit for bit."""
    log_probs, ordered = private(core, "_ddtree_log_probs_and_images")(logits)
    tokens = private(core, "_ddtree_key64_tokens")(ordered, k)
    got_log_probs, got_tokens = got
    assert torch.equal(got_tokens, tokens), name
    assert torch.equal(got_log_probs.view(torch.int32), log_probs.gather(-1, tokens).view(torch.int32)), name


def test_the_fused_log_probs_are_the_torch_path(core: ModuleType, from_kernels: dict, make_logits: MakeLogits) -> None:
    """rc.20's interpreted log-probs kernels give the CPU's float64 path bit for bit, images included,
    a fully masked (NaN) row too; and torch's float32 ``log_softmax`` is within eight units in the last
    place of them (its float32 sum rounds, in an order that depends on the host's vectors: on these rows torch
    2.13 was off by two at most on earlier hosts, by five on an AMD EPYC with AVX2). Versions before rc.20
    have no such kernels."""
    if "_ddtree_triton_log_probs" not in core.build_ddtree_tree.__globals__:
        assert not any(key.startswith("log_probs/") for key in from_kernels)
        return
    ulps = []
    for name, (logits, _) in top_k_cases(make_logits).items():
        got_log_probs, got_images = from_kernels[f"log_probs/{name}"]
        log_probs, images = private(core, "_ddtree_log_probs_and_images")(logits)
        assert torch.equal(got_log_probs.view(torch.int32), log_probs.view(torch.int32)), name
        assert torch.equal(got_images, images), name
        finite = log_probs.isfinite()
        torch_bits = torch.log_softmax(logits.float(), dim=-1)[finite].view(torch.int32).long()
        ulps.append((log_probs[finite].view(torch.int32).long() - torch_bits).abs().max())
    assert max(ulps) <= 8


def test_the_top_k_cases_take_both_ways(from_kernels: dict, spec: str) -> None:
    """rc.28 on: the top-K cases finish some rows from their candidates and send others through the later
    passes and the split, so the equality above holds for both ways. The near-ties rows must fall back:
    their 600 entries share the cut's 16 high bits, more than the 512 candidates k = 200 allows."""
    flags = {key.split("/", 1)[1]: value for key, value in from_kernels.items() if key.startswith("top_k_flags/")}
    if spec not in TOP_K_CANDIDATES:
        assert not flags
        return
    every = torch.cat([value.flatten() for value in flags.values()])
    assert (every == 1).any() and (every == 0).any(), flags
    assert flags["near-ties-k200"].tolist() == [0, 0]


def test_the_order_kernels_warps_grow_with_its_sort(from_kernels: dict, spec: str) -> None:
    """rc.32 on: the order kernel's one-program sort of CAP = 2 * next_pow2(k) keys runs four warps up to
    256 keys, eight up to 1,024 and sixteen above (run 37 call 2 timed 8 at 1,024 keys and 16 at 2,048).
    The interpreter ignores warps, so the rule is read from the version's launcher."""
    if spec not in ORDER_WARPS:
        assert "order_warps" not in from_kernels
        return
    assert from_kernels["order_warps"] == {2: 4, 128: 4, 256: 4, 512: 8, 1024: 8, 2048: 16}


def test_the_vocabulary_chunk_follows_the_grid(core: ModuleType, from_kernels: dict, spec: str,
                                               make_logits: MakeLogits) -> None:
    """rc.33 on: 2,048-entry chunks where 4,096-entry ones would give the SMs fewer than eight programs each
    (rc.35 on: forty, through 138 rows of 151,936 entries on 132 SMs) for (rows, vocabulary, SMs) below, and over either
    chunk the same top-K, the int64 key's, and the same log-probs as the torch path."""
    if spec not in CHUNK_BY_GRID:
        assert "vocab_chunk" not in from_kernels and not any(key.startswith("chunk/") for key in from_kernels)
        return
    small_up_to = 27 if spec in ("ddtree@0.3.0-rc.33", "ddtree@0.3.0-rc.34") else 138  # rows, 151,936 entries, 132 SMs
    assert from_kernels["vocab_chunk"] == {
        **{(rows, 151936, 132): 2048 if rows <= small_up_to else 4096 for rows in CHUNK_RULE_ROWS},
        (15, 151936, 16): 4096 if small_up_to == 27 else 2048, (1, 16, 132): 2048}
    for chunk in (2048, 4096):
        for name, (logits, k) in top_k_cases(make_logits).items():
            assert_the_key_top_k(core, from_kernels[f"chunk/{chunk}/top_k/{name}"], logits, k, f"{chunk}/{name}")
            got_log_probs, got_images = from_kernels[f"chunk/{chunk}/log_probs/{name}"]
            log_probs, images = private(core, "_ddtree_log_probs_and_images")(logits)
            assert torch.equal(got_log_probs.view(torch.int32), log_probs.view(torch.int32)), f"{chunk}/{name}"
            assert torch.equal(got_images, images), f"{chunk}/{name}"


def test_the_top_k_launches_carry_their_register_caps(from_kernels: dict, spec: str) -> None:
    """rc.34 on: the launches over the vocabulary carry the register cap of their chunk, 56 a thread at 2,048
    entries and 96 at 4,096 (under which batch 1's grid fits an H100's SMs at once; ptxas's counts in rc.34's
    docstring): rc.34 every one of them, rc.35 on only those every row takes (the logsumexp's parts, the
    log-probs, the first two counts), not the last count pass and the split; the sort never; none on ROCm,
    whose Triton refuses the option. The interpreter ignores the cap, so the child records each launch's."""
    if spec not in REGISTER_CAPS:
        assert "launch_caps" not in from_kernels
        return
    every_launch = spec == "ddtree@0.3.0-rc.34"
    for chunk, cap in ((2048, 56), (4096, 96)):
        launches = from_kernels["launch_caps"][chunk]
        capped = {"lse", "log_probs", "count 1", "count 2"} | ({"count 3", "split"} if every_launch else set())
        assert launches == {name: {"maxnreg": cap} if name in capped else {}
                            for name in ("lse", "log_probs", "count 1", "count 2", "count 3", "split", "order")}, chunk
    assert all(options == {} for options in from_kernels["launch_caps"]["rocm"].values())


def test_the_build_launches_carry_dependent_launch_where_the_gpu_takes_it(from_kernels: dict, spec: str) -> None:
    """rc.36 on: every launch of the build (the top-K's seven, the pop loop, the visibility kernel) and the log-probs'
    two when they run alone carry ``ddtree_dependent_launch``'s options: USE_GDC (the kernel's wait for the launch
    before it) and Triton's launch_pdl on a CUDA device SGLang's ``is_arch_support_pdl`` accepts, none on an older
    GPU or on the CPU, and from rc.37 none under Triton's interpreter, which cannot run the wait's PTX. The child
    records each launch's options, then runs it without them (the wait's place in each kernel is
    ``test_dependent_launch``'s)."""
    if spec not in DEPENDENT_LAUNCH:
        assert "dependent_launches" not in from_kernels
        return
    on = {"USE_GDC": True, "launch_pdl": True}
    assert from_kernels["dependent_options"] == {"cuda, sm_90 on": on, "cuda, older": {}, "cpu": {},
                                                 "cuda, interpreter": {} if spec in NO_PDL_UNDER_INTERPRETER else on}
    assert from_kernels["dependent_launches"] == dict.fromkeys(
        ("lse", "log_probs", "count 1", "count 2", "count 3", "split", "order", "pop", "visibility", "lse alone",
         "log_probs alone"), on)


def kernel_batch(core: ModuleType, built: dict, budget: int) -> object:
    return core.DDTreeBatch(**built, budget=budget)


# --------------------------------------------------------------------------- the comparisons
@pytest.mark.parametrize(
    ("name", "pop"), [(n, "two-reductions") for n in NAMES] + [(n, "one-reduction") for n in ONE_REDUCTION]
)
def test_kernel_trees_equal_the_heap_and_the_torch_builder(
    core: ModuleType, cases: dict[str, tuple[torch.Tensor, int]], from_kernels: dict[str, dict], name: str, pop: str
) -> None:
    """Both ways of popping (the interpreter's two reductions, the GPU's one) on every case they ran."""
    from tests.ddtree.test_tree_build import assert_same_tree

    logits, budget = cases[name]
    got = kernel_batch(core, from_kernels[f"{name}/{pop}"], budget)
    torch_batch = core.build_ddtree_batch(logits, budget)
    assert got.max_depth == torch_batch.max_depth and got.scores_exact.all()
    for field in FIELDS:  # same padding, dtypes and shapes as the torch builder's
        value, expected = getattr(got, field), getattr(torch_batch, field)
        assert value.dtype == expected.dtype and value.shape == expected.shape, field
        if torch_batch.scores_exact.all():
            assert torch.equal(value, expected), field
    for b in range(logits.shape[0]):  # the heap, node for node, float64 score bits included
        single = core.build_ddtree_tree(logits[b], budget)
        assert int(got.num_nodes[b]) == single.num_nodes
        assert_same_tree(single, got.tree(b))
        core.assert_prefix_closed(got.tree(b))


def test_the_cases_hold_what_the_kernel_must_get_right(core: ModuleType, cases: dict, from_kernels: dict) -> None:
    """Exact score ties inside trees, a token under many parents, short and root-only trees, and scores
    that differ from the closed form parent + logp (the fold's float64 rounding, where the torch
    builder's one replay pass gives up): the cases are hard."""
    from tests.ddtree.test_tree_build import rank_paths

    trees = {name: kernel_batch(core, from_kernels[f"{name}/two-reductions"], cases[name][1]) for name in NAMES}
    tied = repeated = 0
    for tree in trees.values():
        for b in range(tree.num_nodes.shape[0]):
            one = tree.tree(b)
            tied += one.scores.unique().numel() < one.num_nodes
            pairs = set(zip(one.tokens.tolist(), one.parents[1:].tolist(), strict=True))
            tokens = [token for token, _ in pairs]
            repeated += max((tokens.count(t) for t in tokens), default=0) >= 3
    assert tied >= 10 and repeated >= 10, (tied, repeated)
    assert trees["integer-bs2-L4-V3-B200"].num_nodes.tolist() == [120, 120]
    assert trees["minus-inf-rows-B40"].num_nodes.tolist() == [16, 0, 4]
    assert trees["integer-bs1-L15-V40-B1024"].num_nodes.tolist() == [1024]
    for name in (n for n in NAMES if n.startswith("rounding")):
        logits, budget = cases[name][0][0], cases[name][1]
        tree = trees[name].tree(0)
        top, _ = private(core, "_ddtree_top_k")(logits, min(budget, logits.shape[-1]))
        parents, scores = tree.parents.tolist(), [0.0] + tree.scores.tolist()
        closed_form = [scores[parents[i]] + top[len(p) - 1, p[-1]].double().item() for i, p in enumerate(rank_paths(SimpleNamespace(_ddtree_top_k=private(core, "_ddtree_top_k")), logits, tree), 1)]
        assert closed_form != scores[1:], name
        assert not core.build_ddtree_batch(logits[None], budget).scores_exact.all(), name


def test_the_kernels_answered_every_case(from_kernels: dict, core: ModuleType, make_logits: MakeLogits, spec: str) -> None:
    """The child's trees came from the interpreted kernels, not from the torch code beside them: the
    dispatch the version looks up (a split core's in its tree's and builder's modules) was reached."""
    calls = from_kernels["calls"]
    assert calls["build"] == len(NAMES) + len(ONE_REDUCTION)
    has_top_k = "_ddtree_key64_tokens" in core.build_ddtree_tree.__globals__  # rc.16 on
    assert calls["top_k"] >= (len(top_k_cases(make_logits)) + calls["build"] if has_top_k else 0)
    has_log_probs = "_ddtree_triton_log_probs" in core.build_ddtree_tree.__globals__  # rc.20 on
    # rc.20 and rc.21's top-K takes the log-probs' kernels' images; rc.22's makes its own from the logits
    through_log_probs = 0 if spec in TOP_K_FROM_LOGITS else calls["top_k"]
    assert calls["log_probs"] == (len(top_k_cases(make_logits)) + through_log_probs if has_log_probs else 0)


def test_launcher_refuses_what_its_key_cannot_hold(from_kernels: dict, spec: str) -> None:
    bound = MAX_BUDGET.get(spec, 1 << 16)
    assert from_kernels["refusals"] == [
        f"budget must be in [1, {bound}), got 0.",
        f"budget must be in [1, {bound}), got {bound}.",
        "log_probs must be [bs, 1..255, 1..budget], got (1, 2, 5).",
        "top_tokens must have shape (1, 2, 3), got (1, 2, 4).",
    ]


@pytest.mark.parametrize("budget", [0, -3])
def test_non_positive_budgets_stay_root_only_without_the_kernel(
    core: ModuleType, monkeypatch: pytest.MonkeyPatch, budget: int
) -> None:
    # where build_ddtree_batch looks it up: ddtree_utils.py's globals, or a split core's builder's
    monkeypatch.setitem(core.build_ddtree_batch.__globals__, "_ddtree_triton_builder",
                        lambda device: pytest.fail("kernel called"))
    batch = core.build_ddtree_batch(torch.randn(2, 4, 16), budget)
    assert batch.num_nodes.tolist() == [0, 0] and batch.parents.shape == (2, max(budget, 0) + 1)


def test_the_cpu_keeps_the_torch_builder(core: ModuleType) -> None:
    assert private(core, "_ddtree_triton_builder")(torch.device("cpu")) is None


# --------------------------------------------------------------------------- the child process
def _load(path: Path, package: str = "sglang.srt.speculative") -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"{path.stem}_rc3", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    sys.modules[f"{package}.{path.stem}"] = module  # a split core's later modules (or kernel modules) import it
    spec.loader.exec_module(module)
    return module


def _refusals(kernel: ModuleType) -> list[str]:
    bound = getattr(kernel, "_MAX_BUDGET", 1 << 16)  # the budget it must refuse first (the parent checks it)
    calls = [
        (torch.zeros(1, 2, 3), torch.zeros(1, 2, 3, dtype=torch.int64), 0),
        (torch.zeros(1, 2, 3), torch.zeros(1, 2, 3, dtype=torch.int64), bound),
        (torch.zeros(1, 2, 5), torch.zeros(1, 2, 5, dtype=torch.int64), 4),
        (torch.zeros(1, 2, 3), torch.zeros(1, 2, 4, dtype=torch.int64), 4),
    ]
    messages = []
    for log_probs, top_tokens, budget in calls:
        try:
            kernel.build_ddtree_trees_triton(log_probs=log_probs, top_tokens=top_tokens, budget=budget)
        except ValueError as err:
            messages.append(str(err))
    return messages


def _adversarial_select(real_topk: Callable[..., Any]) -> Callable[..., Any]:
    """``Tensor.topk`` as the Triton top-K's select of int32 images may come out on a GPU: right as a set
    above the k-th value, the entries at that value with the LARGEST ids, the k shuffled. (The CPU's
    own select takes the smallest ids in order, which would leave the repair nothing to do.)"""

    def topk(self: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True) -> Any:
        if self.dtype != torch.int32:
            return real_topk(self, k, dim=dim, largest=largest, sorted=sorted)
        key = self.to(torch.int64) * (1 << 32) + torch.arange(self.shape[-1])  # larger id first on ties
        shuffle = torch.randperm(k, generator=torch.Generator().manual_seed(k))
        tokens = real_topk(key, k, dim=-1).indices[..., shuffle]
        return self.gather(-1, tokens), tokens

    return topk


@contextlib.contextmanager
def _radix_states(top_k_kernel: ModuleType) -> Iterator[list[torch.Tensor]]:
    """rc.28 on: every radix state the top-K allocates inside the block, kept to read its rows' flags
    after each call."""
    states: list[torch.Tensor] = []
    words = getattr(top_k_kernel, "_DDTREE_RADIX_STATE", None)
    if words is None or not hasattr(top_k_kernel, "_DDTREE_FLAG_WORD"):
        yield states
        return
    real_empty = torch.empty

    def empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        tensor = real_empty(*args, **kwargs)
        if tensor.dim() == 2 and tensor.shape[1] == words.value and tensor.dtype == torch.int32:
            states.append(tensor)
        return tensor

    with mock.patch.object(torch, "empty", empty):
        yield states


def _on_garbage(build: Callable[..., Any]) -> Callable[..., Any]:
    """``build`` with every tensor it allocates by ``torch.empty`` filled with garbage first (True, 0x5A or NaN),
    so that an output element the kernels leave unwritten shows (on the CPU, ``torch.empty`` often hands out fresh
    pages, which are zero, where a GPU's allocator hands back what an earlier kernel wrote)."""
    real_empty = torch.empty

    def garbage(*args: Any, **kwargs: Any) -> torch.Tensor:
        tensor = real_empty(*args, **kwargs)
        if tensor.dtype == torch.bool:
            return tensor.fill_(True)
        return tensor.fill_(float("nan") if tensor.is_floating_point() else 0x5A)

    def call(*args: Any, **kwargs: Any) -> Any:
        with mock.patch.object(torch, "empty", garbage):
            return build(*args, **kwargs)
    return call


def _build_with_kernels(work: Path) -> None:
    """The version's build_ddtree_batch with its CUDA dispatch pointed at the interpreted kernels (rc.16 on:
    its Triton top-K too), and that top-K alone on ``top_k_cases``."""
    assert os.environ["TRITON_INTERPRET"] == "1" and "triton" not in sys.modules
    from tests.ddtree.launch_recorder import dependent_launches, launch_caps
    from tests.ddtree.triton_cpu import stand_in_pdl_check
    torch.set_num_threads(1)
    launch_path = work / Path(LAUNCH).name
    if launch_path.exists():  # rc.36 on: the kernel modules import it, and it SGLang's PDL check (stood in for)
        stand_in_pdl_check()
        launch = _load(launch_path, "sglang.kernels.ops.speculative")
    core = {path.stem: _load(path) for path in (work / Path(p).name for p in CORE) if path.exists()}
    utils, kernel = core["ddtree_utils"], _load(work / Path(KERNEL).name)
    top_k_path = work / Path(TOP_K_KERNEL).name
    top_k_kernel = _load(top_k_path) if top_k_path.exists() else kernel
    # Where the CUDA dispatch is looked up: ddtree_utils.py's own, or a split core's tree and builder.
    top_k_home, builder_home = core.get("ddtree_tree", utils), core.get("ddtree_builder", utils)
    calls = {"top_k": 0, "build": 0, "log_probs": 0}  # so the parent knows the kernels, not the torch code, answered

    def counted(what: str, kernel_op: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[what] += 1
            return kernel_op(*args, **kwargs)
        return call

    trees: dict[str, object] = {"refusals": _refusals(kernel), "calls": calls}
    cases = torch.load(work / "cases.pt")
    if hasattr(top_k_kernel, "ddtree_log_probs_triton"):  # rc.20 on
        top_k_home._ddtree_triton_log_probs = lambda device: counted("log_probs", top_k_kernel.ddtree_log_probs_triton)
        for name, (logits, _) in cases["top_k"].items():
            trees[f"log_probs/{name}"] = top_k_home._ddtree_log_probs_and_images(logits)
    if hasattr(top_k_kernel, "_ddtree_order_warps"):  # rc.32 on
        trees["order_warps"] = {cap: top_k_kernel._ddtree_order_warps(cap) for cap in (2, 128, 256, 512, 1024, 2048)}
    if hasattr(top_k_kernel, "_DDTREE_CHUNK_REGISTERS"):  # rc.34 on
        trees["launch_caps"] = launch_caps(top_k_kernel, *cases["top_k"]["bf16-k7"])
    if launch_path.exists():
        trees.update(dependent_launches(launch, top_k_kernel, kernel, *cases["top_k"]["bf16-k7"]))
    if hasattr(top_k_kernel, "_ddtree_vocab_chunk"):  # rc.33 on
        rule = top_k_kernel._ddtree_vocab_chunk
        grids = [(rows, 151936, 132) for rows in CHUNK_RULE_ROWS] + [(15, 151936, 16), (1, 16, 132)]
        trees["vocab_chunk"] = {grid: rule(*grid) for grid in grids}
        for chunk in top_k_kernel._DDTREE_VOCAB_CHUNKS:
            with mock.patch.object(top_k_kernel, "_ddtree_vocab_chunk", lambda rows, vocab, sms, chunk=chunk: chunk):
                for name, (logits, k) in cases["top_k"].items():
                    trees[f"chunk/{chunk}/log_probs/{name}"] = top_k_kernel.ddtree_log_probs_triton(logits)
                    trees[f"chunk/{chunk}/top_k/{name}"] = top_k_kernel.ddtree_top_k_triton(draft_logits=logits, k=k)
    if hasattr(top_k_kernel, "ddtree_top_k_triton"):
        top_k_home._ddtree_triton_top_k = lambda device: counted("top_k", top_k_kernel.ddtree_top_k_triton)
        torch.Tensor.topk = _adversarial_select(torch.Tensor.topk)  # this child process only
        with _radix_states(top_k_kernel) as states:
            for name, (logits, k) in cases["top_k"].items():
                trees[f"top_k/{name}"] = top_k_home._ddtree_top_k(logits, k)
                if states:  # the flag word of the tail, which starts halfway through the state
                    state = states.pop()
                    trees[f"top_k_flags/{name}"] = state[:, state.shape[1] // 2 + top_k_kernel._DDTREE_FLAG_WORD.value]
    for pop, names in (("two-reductions", NAMES), ("one-reduction", ONE_REDUCTION)):
        builder = _on_garbage(functools.partial(kernel.build_ddtree_trees_triton, one_reduction=pop == "one-reduction"))
        builder_home._ddtree_triton_builder = lambda device, builder=builder: counted("build", builder)
        for name in names:
            tree = utils.build_ddtree_batch(*cases[name])
            trees[f"{name}/{pop}"] = {field: getattr(tree, field) for field in (*FIELDS, "scores_exact", "max_depth")}
    torch.save(trees, work / "trees.pt")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: tests.ddtree's helpers
    _build_with_kernels(Path(sys.argv[1]))
