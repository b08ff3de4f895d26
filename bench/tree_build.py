"""Benchmark: DDTree batch tree builder (overlay ddtree_utils.build_ddtree_batch) against a plain
best-first heap on the host, at L = 15, V = 151936, budgets 16..1024, batch 1 and 8; on CUDA also
the fused Triton builder (the top-K, then ``ddtree_build.py``'s one program per request running the
pop loop), which ``build_ddtree_batch`` runs on CUDA from overlay 0.3.0-rc.3 on: the previous
(``PREVIOUS``, rc.16: torch's log-softmax, its Triton 32-bit top-K with its ties repaired, one pop per
reduction of the frontier) and the newest (``NEWEST``, rc.39: Triton log-probs and a radix-select top-K
in ``ddtree_top_k.py`` from the logits, each pass's cut picked once per row, a row with few candidates
after two passes finished from them, the sort's warps by its width, 2,048-entry chunks through batch 9,
the registers of the launches every row takes capped by the chunk, each launch waiting on the one before;
two pops per reduction of a frontier of int32 keys after the log-prob table is read into L1, the
reduction's comparisons made before its choices, the frontier's width doubling as the nodes fill it, the
tokens gathered after the loop, the visibility written a byte per ancestor) side by side, and the newest
kernel at each ``--warps`` count.

The heap baseline is written here, from the spec (DDTREE.md), the way public ports do it:
log-softmax and top-K on the device, one copy to the host, a Python heap per request, then the
tree (tokens, parents, visibility) copied back to the device. The batched builder stays on the
device; on CUDA it runs under ``torch.cuda.set_sync_debug_mode("error")`` (any host sync
raises) and is also timed as a replayed CUDA graph; so is each Triton builder (top-K plus its two
kernels), whose trees must equal its own version's torch builder's exactly (tokens, scores, parents,
visibility; from rc.20 the log-probs' last bit is the version's own, so 0.1.0's torch builder no
longer gives the same trees at near-ties).

    python bench/tree_build.py                      # CPU
    python bench/tree_build.py --device cuda        # GPU

Prints times per call and the ratios heap / batch (and, on CUDA, heap / graph, heap / triton graph
for the previous Triton builder and the newest, and each one's graphed top-K alone), all measured in
this one run.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import heapq
import importlib.util
import math
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING
from unittest import mock

import numpy as np
import torch

if TYPE_CHECKING:
    from ddtree_deploy.overlay import Overlay

OVERLAYS = Path(__file__).resolve().parents[1] / "overlays/ddtree"
DDTREE_UTILS = OVERLAYS / "0.1.0/files/sglang/srt/speculative/ddtree_utils.py"
PREVIOUS = "ddtree@0.3.0-rc.16"  # one pop per reduction (rc.17 and rc.18 run its kernel and top-K)
NEWEST = "ddtree@0.3.0-rc.39"  # rc.37 whose pop loop's reduction compares before it chooses
KERNEL = "sglang/kernels/ops/speculative/ddtree_build.py"
TOP_K_KERNEL = "sglang/kernels/ops/speculative/ddtree_top_k.py"  # rc.21 on: the log-probs and top-K kernels
LAUNCH = "sglang/kernels/ops/speculative/ddtree_launch.py"  # rc.36 on: the kernels' dependent launch options
# Where a version defines _ddtree_top_k: a split core's tree module (rc.18 on), else its ddtree_utils.py.
TOP_K_HOMES = ("sglang/srt/speculative/ddtree_tree.py", "sglang/srt/speculative/ddtree_utils.py")
BUILDER = "sglang/srt/speculative/ddtree_builder.py"  # a split core's batch builder
TREE_MODULE = "sglang.srt.speculative.ddtree_tree"
LAUNCH_MODULE = "sglang.kernels.ops.speculative.ddtree_launch"


def load_module(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def load_ddtree_utils() -> ModuleType:
    return load_module("ddtree_utils_overlay", DDTREE_UTILS)


@functools.lru_cache(maxsize=1)
def overlay_files() -> Path:
    """One temporary folder for the run's overlay files, made on first use and removed at exit."""
    folder = tempfile.TemporaryDirectory(prefix="ddtree_bench_")
    atexit.register(folder.cleanup)
    return Path(folder.name)


@functools.cache  # resolving a version applies every edit of its chain
def version_overlay(spec: str) -> Overlay:
    from ddtree_deploy.catalog import load_overlay

    return load_overlay(spec, OVERLAYS.parent)


def load_version_file(spec: str, path: str) -> ModuleType:
    """``path`` (inside the sglang package) as version ``spec`` lands it, resolved through its parents and
    edits, written to a file first (Triton reads a kernel's source from its file)."""
    overlay = version_overlay(spec)
    tag = re.sub(r"\W", "_", overlay.version)
    target = overlay_files() / f"{Path(path).stem}_{tag}.py"
    target.write_bytes(overlay.content_of(path, None))
    return load_module(target.stem, target)


def load_version_pair(spec: str) -> tuple[ModuleType, ModuleType]:
    """The module holding version ``spec``'s ``_ddtree_top_k`` (a split core's tree module, else its
    ddtree_utils) and its Triton tree build, the top-K's CUDA path (and from rc.20 the log-probs') pointed
    at its kernels, from rc.21 in a module of their own (the bench's sglang is the pristine release, where the
    core's own import finds none)."""
    files = version_overlay(spec).manifest.files
    if LAUNCH in files:  # the kernel modules import it by its sglang name as they load
        sys.modules[LAUNCH_MODULE] = load_version_file(spec, LAUNCH)
    core = load_version_file(spec, next(path for path in TOP_K_HOMES if path in files))
    kernel = load_version_file(spec, KERNEL)
    top_k = load_version_file(spec, TOP_K_KERNEL) if TOP_K_KERNEL in files else kernel
    core._ddtree_triton_top_k = lambda device: top_k.ddtree_top_k_triton if device.type == "cuda" else None
    if hasattr(top_k, "ddtree_log_probs_triton"):
        core._ddtree_triton_log_probs = lambda device: top_k.ddtree_log_probs_triton if device.type == "cuda" else None
    return core, kernel


def load_newest_pair() -> tuple[ModuleType, ModuleType]:
    return load_version_pair(NEWEST)


def load_torch_builder(spec: str, top_k_home: ModuleType) -> Callable[[torch.Tensor, int], object]:
    """Version ``spec``'s own ``build_ddtree_batch`` with its Triton tree build turned off: the torch batch
    builder on the version's log-probs and top-K (``top_k_home``'s), which the Triton build must equal."""
    if BUILDER not in version_overlay(spec).manifest.files:
        module = top_k_home  # a whole core: its ddtree_utils.py builds too
    else:  # a split core's builder imports the tree module by its sglang name, only while it loads
        with mock.patch.dict(sys.modules, {TREE_MODULE: top_k_home}):
            module = load_version_file(spec, BUILDER)
    module._ddtree_triton_builder = lambda device: None
    return module.build_ddtree_batch


# --------------------------------------------------------------------------- the heap baseline
def heap_tree(log_probs: list[list[float]], token_ids: list[list[int]], budget: int) -> tuple[list[int], list[int]]:
    """Best-first expansion of one request: (node tokens, parents with parents[0] = -1)."""
    depth_limit, k = len(log_probs), len(log_probs[0])
    tokens: list[int] = []
    parents = [-1]
    heap: list[tuple[float, tuple[int, ...], int, int, int, float]] = [
        (-log_probs[0][0], (0,), 0, 1, 0, log_probs[0][0])
    ]
    while heap and len(tokens) < budget:
        _, ranks, parent, depth, rank, score = heapq.heappop(heap)
        tokens.append(token_ids[depth - 1][rank])
        parents.append(parent)
        node = len(tokens)
        row = log_probs[depth - 1]
        if rank + 1 < k:
            sibling = score - row[rank] + row[rank + 1]
            heapq.heappush(heap, (-sibling, ranks[:-1] + (rank + 1,), parent, depth, rank + 1, sibling))
        if depth < depth_limit:
            child = score + log_probs[depth][0]
            heapq.heappush(heap, (-child, ranks + (0,), node, depth + 1, 0, child))
    return tokens, parents


def heap_build(draft_logits: torch.Tensor, budget: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Trees of a batch built one request at a time on the host; results back on the device."""
    bs, _, vocab = draft_logits.shape
    log_probs = torch.log_softmax(draft_logits.float(), dim=-1)
    top, ids = log_probs.topk(min(budget, vocab), dim=-1)
    top_host, ids_host = top.double().cpu().tolist(), ids.cpu().tolist()
    tokens = np.zeros((bs, budget), dtype=np.int64)
    parents = np.zeros((bs, budget + 1), dtype=np.int64)
    visibility = np.zeros((bs, budget + 1, budget + 1), dtype=np.bool_)
    for b in range(bs):
        node_tokens, node_parents = heap_tree(top_host[b], ids_host[b], budget)
        tokens[b, : len(node_tokens)] = node_tokens
        parents[b, : len(node_parents)] = node_parents
        visibility[b, 0, 0] = True
        for i in range(1, len(node_parents)):
            visibility[b, i, :i] = visibility[b, node_parents[i], :i]
            visibility[b, i, i] = True
    device = draft_logits.device
    return (
        torch.from_numpy(tokens).to(device),
        torch.from_numpy(parents).to(device),
        torch.from_numpy(visibility).to(device),
    )


# --------------------------------------------------------------------------- the Triton builder
@dataclass(frozen=True)
class TritonBuilder:
    """What ``build_ddtree_batch`` runs on CUDA from rc.3 on: the ``_ddtree_top_k`` of ``core``, then the
    fused kernels of ``kernel``, at ``num_warps`` (None: the launcher's own rule); ``reference`` is the
    version's torch batch builder, which it must equal."""

    core: ModuleType
    kernel: ModuleType
    reference: Callable[[torch.Tensor, int], object]
    num_warps: int | None = None

    @classmethod
    def of(cls, spec: str) -> TritonBuilder:
        core, kernel = load_version_pair(spec)
        return cls(core, kernel, load_torch_builder(spec, core))

    def top_k(self, draft_logits: torch.Tensor, budget: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The top-K the build starts from (timed alone: how much of the build it is)."""
        depth_limit = min(draft_logits.shape[1], budget)
        return self.core._ddtree_top_k(draft_logits[:, :depth_limit], min(budget, draft_logits.shape[-1]))

    def build(self, draft_logits: torch.Tensor, budget: int) -> tuple[torch.Tensor, ...]:
        """(tokens, depths, parents, visibility, scores, num_nodes)."""
        top, ids = self.top_k(draft_logits, budget)
        warps = {} if self.num_warps is None else {"num_warps": self.num_warps}
        return self.kernel.build_ddtree_trees_triton(log_probs=top, top_tokens=ids, budget=budget, **warps)


def check_triton_same(builder: TritonBuilder, logits: torch.Tensor, budget: int) -> None:
    """The Triton trees equal the version's torch builder's bit for bit (an exact top-K, so tokens agree too)."""
    batch = builder.reference(logits, budget)
    got = builder.build(logits, budget)
    for name, value in zip(("tokens", "depths", "parents", "visibility", "scores", "num_nodes"), got, strict=True):
        if not torch.equal(value, getattr(batch, name)):
            raise SystemExit(f"triton builder disagrees with the batch builder at budget {budget}: {name}")


# --------------------------------------------------------------------------- timing
def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds per call (after one warm-up call)."""
    fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def graph_replay(build: Callable[[torch.Tensor, int], object], logits: torch.Tensor, budget: int) -> Callable[[], object] | None:
    """A CUDA graph of ``build(logits, budget)`` on a static logits buffer (None if capture fails)."""
    static = logits.clone()
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        build(static, budget)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            build(static, budget)
    except RuntimeError as err:
        print(f"  cuda graph capture failed at budget {budget}: {err}")
        return None
    return graph.replay


def check_same(dd: ModuleType, logits: torch.Tensor, budget: int) -> None:
    """Both builders give the same tree shape in the same node order. (Tokens can differ
    between exactly tied log-probs: plain topk orders ties its own way.)"""
    _, parents, visibility = heap_build(logits, budget)
    batch = dd.build_ddtree_batch(logits, budget)
    if not (torch.equal(parents, batch.parents) and torch.equal(visibility, batch.visibility)):
        raise SystemExit(f"builders disagree at budget {budget}")


def graphed_columns(
    dd: ModuleType, builders: tuple[TritonBuilder, TritonBuilder], warps: list[int], logits: torch.Tensor,
    budget: int, heap_s: float, repeats: int,
) -> str:
    """The CUDA-graph columns: the torch batch builder, the previous and the newest Triton builder with each
    one's top-K alone, then the newest at each count of ``warps`` (heap / time)."""
    newest = builders[1]
    timings: list[tuple[Callable[[torch.Tensor, int], object], int]] = [(dd.build_ddtree_batch, 10)]
    for builder in builders:
        check_triton_same(builder, logits, budget)
        torch.cuda.set_sync_debug_mode("error")  # the Triton build has no host sync either
        builder.build(logits, budget)
        torch.cuda.set_sync_debug_mode("default")
        timings += [(builder.build, 11), (builder.top_k, 0)]
    for count in warps:
        at_count = replace(newest, num_warps=count)
        check_triton_same(at_count, logits, budget)
        timings.append((at_count.build, 8))
    cells = []
    for build, width in timings:
        replay = graph_replay(build, logits, budget)
        graph_s = timed(replay, logits.device, repeats) if replay is not None else math.nan
        cells.append(f" {graph_s * 1e3:>9.3f}" + (f" {heap_s / graph_s:>{width}.2f}" if width else ""))
    return "".join(cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64, 128, 256, 512, 1024])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--length", type=int, default=15)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--warps", type=int, nargs="*", default=[], help="CUDA: also the newest kernel at these warps")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dd = load_ddtree_utils()
    cuda = device.type == "cuda"
    builders = (TritonBuilder.of(PREVIOUS), TritonBuilder.of(NEWEST)) if cuda else None
    print(f"device {device} ({torch.cuda.get_device_name(device) if cuda else f'{torch.get_num_threads()} threads'})")
    print(f"torch {torch.__version__}, L={args.length}, V={args.vocab}, bf16 logits, median of {args.repeats}")
    header = f"{'bs':>3} {'budget':>6} {'heap ms':>9} {'batch ms':>9} {'heap/batch':>10}"
    if cuda:
        header += f" {'graph ms':>9} {'heap/graph':>10}"
        for label in (PREVIOUS.rsplit("-", 1)[1], NEWEST.rsplit("-", 1)[1]):
            header += f" {label + ' ms':>9} {'heap/' + label:>11} {label + ' top-K':>9}"
        header += "".join(f" {f'{w}w ms':>9} {'heap/' + str(w) + 'w':>8}" for w in args.warps)
    print(header)
    g = torch.Generator(device="cpu").manual_seed(0)
    for bs in args.batch:
        # Draft-like logits: a confident head at some depths, a long flat tail.
        logits = torch.randn(bs, args.length, args.vocab, generator=g) * 2.0
        logits[:, :, :8] += torch.rand(bs, args.length, 8, generator=g) * 12.0
        logits = logits.to(torch.bfloat16).to(device)
        for budget in args.budgets:
            check_same(dd, logits, budget)
            heap_s = timed(functools.partial(heap_build, logits, budget), device, args.repeats)
            if cuda:
                torch.cuda.set_sync_debug_mode("error")  # a host sync inside the build raises
            batch_s = timed(functools.partial(dd.build_ddtree_batch, logits, budget), device, args.repeats)
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
            line = f"{bs:>3} {budget:>6} {heap_s * 1e3:>9.3f} {batch_s * 1e3:>9.3f} {heap_s / batch_s:>10.2f}"
            if builders is not None:
                line += graphed_columns(dd, builders, args.warps, logits, budget, heap_s, args.repeats)
            print(line, flush=True)


if __name__ == "__main__":
    main()
