"""Benchmark: a GatedDeltaNet layer's causal conv1d in a tree verify. SGLang 0.5.17's tree mode of
``causal_conv1d_update`` against overlay ddtree's ``ddtree_conv1d_tree`` (0.3.0-rc.9 and later), with
SGLang's chain (DFLASH's verify over the draft block) as the baseline.

SGLang's tree mode derives the parents from the links and walks each node's ancestors one node
after another; run 23's profile found it the largest kernel of a DDTREE@64 round on the copy
hybrid (66 us a launch, 13x the chain's). Ours handles every node at once; from rc.10 it derives
the parents once a forward (the first GDN layer) and every later layer reads them, so each budget
is checked and timed both ways (a first and a later layer). Before timing, each budget checks our results
against SGLang's bit for bit (outputs, per-node windows, derived
parents, the rolled conv state; a different DDTree-shaped tree per request, and one padded
request) and over ``--equal`` replays of one CUDA graph. Times are CUDA-event medians of
``--repeats`` replays of a CUDA graph holding one call, as the server runs it.

    ddtree-deploy overlay export ddtree@0.3.0-rc.10 /tmp/rc10
    PYTHONPATH=/tmp/site python bench/conv1d_tree_verify.py --ddtree-file /tmp/rc10/files/sglang/kernels/ops/speculative/ddtree_conv1d.py
    ... --shapes copy-hybrid --requests 4
    ... --configs 32x16x4,64x32x8   # rc.11 and later: our kernel at each tile config (channels x rows x warps)
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import statistics
import time
from collections.abc import Callable
from types import ModuleType

import torch

SGLANG_MODULE = "sglang.kernels.ops.mamba.causal_conv1d_triton"
# Conv channels (2 x key heads x 128 + value heads x 128), GDN layers, DFLASH's block.
SHAPES = {"qwen3.6-27b": (10240, 48, 16), "copy-hybrid": (512, 5, 8), "small": (24, 2, 4)}
WIDTH = 4  # the conv kernel of every GDN layer


def load_ddtree(path: str) -> ModuleType:
    """Our ``ddtree_conv1d.py`` from a file (it imports SGLang's kernel module by name)."""
    spec = importlib.util.spec_from_file_location("ddtree_conv1d", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def random_parents(width: int, max_depth: int, g: torch.Generator) -> list[int]:
    """A random tree whose every parent comes first (node 0 the root, parent -1), recent nodes the
    likelier parents, no deeper than ``max_depth``: the shape DDTree's pop order gives."""
    parents, depths = [-1], [0]
    for node in range(1, width):
        choices = [p for p in range(node) if depths[p] < max_depth]
        weights = torch.tensor([1.0 + p for p in choices])
        parent = choices[int(torch.multinomial(weights, 1, generator=g))]
        parents.append(parent)
        depths.append(depths[parent] + 1)
    return parents


def links(parents: list[int]) -> tuple[list[int], list[int]]:
    """SGLang's ``retrieve_next_token`` / ``retrieve_next_sibling`` of a tree: a node's first child
    and its next sibling, children in index order (as ``tree_links`` gives DDTree's)."""
    next_token, next_sibling, last_child = [-1] * len(parents), [-1] * len(parents), {}
    for node, parent in enumerate(parents):
        if parent < 0:
            continue
        if parent in last_child:
            next_sibling[last_child[parent]] = node
        else:
            next_token[parent] = node
        last_child[parent] = node
    return next_token, next_sibling


class Case:
    """One verify call's inputs: ``requests`` trees of ``width`` nodes (or a chain) over ``dim``
    channels; the last request is a padded row (conv state slot -1) when ``padded``."""

    def __init__(self, dim: int, requests: int, width: int, tree: bool, device: str, dtype: torch.dtype,
                 seed: int, padded: bool = False, max_depth: int = 16):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn((requests, width, dim), generator=g).to(device, dtype).transpose(1, 2)
        self.weight = torch.randn((dim, WIDTH), generator=g).to(device, dtype)
        self.bias = torch.randn(dim, generator=g).to(device, dtype)
        self.conv_state = torch.randn((requests + 2, dim, WIDTH - 1), generator=g).to(device, dtype)
        slots = list(range(2, requests + 2))
        if padded:
            slots[-1] = -1
        self.slots = torch.tensor(slots, dtype=torch.int32, device=device)
        self.inter_slots = torch.tensor(list(range(requests))[::-1], dtype=torch.int32, device=device)
        self.inter = torch.zeros((requests + 1, width, dim, WIDTH - 1), device=device, dtype=dtype)
        self.next_token = self.next_sibling = self.parents = None
        if tree:
            pairs = [links(random_parents(width, max_depth, g)) for _ in range(requests)]
            self.next_token = torch.tensor([p[0] for p in pairs], dtype=torch.int32, device=device)
            self.next_sibling = torch.tensor([p[1] for p in pairs], dtype=torch.int32, device=device)
            self.parents = torch.full((requests, width), -7, dtype=torch.int32, device=device)

    def clone(self) -> Case:
        twin = object.__new__(Case)
        twin.__dict__ = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in self.__dict__.items()}
        return twin

    def call(self, kernel: Callable[..., torch.Tensor]) -> torch.Tensor:
        """As ``gdn_backend.py``'s target verify calls it."""
        return kernel(self.x, self.conv_state, self.weight, self.bias, "silu", conv_state_indices=self.slots,
                      intermediate_conv_window=self.inter, intermediate_state_indices=self.inter_slots,
                      retrieve_next_token=self.next_token, retrieve_next_sibling=self.next_sibling,
                      retrieve_parent_token=self.parents)

    def results(self, out: torch.Tensor) -> list[torch.Tensor]:
        real = self.slots >= 0  # a padded row is left as it was, by both kernels
        found = [out[real], self.conv_state, self.inter]
        return found + ([self.parents[real]] if self.parents is not None else [])


def graphed(call: Callable[[], torch.Tensor], device: str) -> Callable[[], torch.Tensor]:
    call()  # compile
    if device != "cuda":
        return call
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    return lambda: (graph.replay(), out)[1]


def same_as_sglang(sglang: Callable, ours: Callable, dim: int, requests: int, width: int, device: str,
                   dtype: torch.dtype, replays: int, parents_ready: bool = False) -> tuple[bool, int]:
    """Whether ours gives SGLang's results exactly, and in how many of ``replays`` replays again;
    with ``parents_ready``, as a later layer: the parents already there (SGLang's)."""
    case = Case(dim, requests, width, True, device, dtype, seed=width + requests, padded=requests > 1)
    theirs, mine = case.clone(), case.clone()
    want = theirs.results(theirs.call(sglang))
    if parents_ready:
        case.parents.copy_(theirs.parents)
        mine.parents.copy_(theirs.parents)
        ours = functools.partial(ours, parents_ready=True)
    equal = all(torch.equal(a, b) for a, b in zip(want, mine.results(mine.call(ours)), strict=True))
    again = case.clone()
    run = graphed(lambda: again.call(ours), device)
    same = 0
    for _ in range(replays):
        for name in ("conv_state", "inter", "parents"):
            getattr(again, name).copy_(getattr(case, name))
        out = run()
        same += all(torch.equal(a, b) for a, b in zip(want, again.results(out), strict=True))
    return equal, same


def median_ms(kernel: Callable, case: Case, device: str, repeats: int) -> float:
    run = graphed(lambda: case.call(kernel), device)
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            run()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def sweep(sglang: Callable, ours: Callable, args: argparse.Namespace, configs: list[tuple[int, ...]],
          dtype: torch.dtype) -> int:
    """Each budget's SGLang time, then each config's: equal to SGLang's (a first and a later layer,
    ``--equal`` replays) and a later layer's median (a round is almost all later layers)."""
    dim, _, _ = SHAPES[args.shapes]
    failed = False
    for budget in (int(b) for b in args.budgets.split(",")):
        case = Case(dim, args.requests, budget + 1, True, args.device, dtype, budget)
        theirs = median_ms(sglang, case.clone(), args.device, args.repeats)
        print(f"{args.shapes}, {args.requests} requests, tree of {budget + 1}: SGLang {theirs * 1e3:.1f} us")
        for config in configs:
            kernel = functools.partial(ours, config=config)
            checks = [same_as_sglang(sglang, kernel, dim, args.requests, budget + 1, args.device, dtype,
                                     args.equal, parents_ready=ready) for ready in (False, True)]
            ok = all(equal and same == args.equal for equal, same in checks)
            failed |= not ok
            later_case = case.clone()
            later_case.call(kernel)
            later = median_ms(functools.partial(kernel, parents_ready=True), later_case, args.device, args.repeats)
            print(f"  {'x'.join(map(str, config))}: {later * 1e3:.1f} us a later layer ({theirs / later:.2f}x "
                  f"SGLang's){'' if ok else ' DIFFERENT from SGLang'}")
    return int(failed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--ddtree-file", required=True, help="the overlay's ddtree_conv1d.py (rc.10 or later)")
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="qwen3.6-27b")
    parser.add_argument("--budgets", default="16,64,256")
    parser.add_argument("--requests", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--equal", type=int, default=20, metavar="REPLAYS")
    parser.add_argument("--no-timing", action="store_true", help="the equality check only")
    parser.add_argument("--configs", metavar="CHANNELSxROWSxWARPS,...",
                        help="instead: check and time our kernel at each of these tile configs (rc.11 and later)")
    args = parser.parse_args(argv)
    sglang = importlib.import_module(SGLANG_MODULE).causal_conv1d_update
    module = load_ddtree(args.ddtree_file)
    ours = module.ddtree_conv1d_tree  # the kernel itself, whatever the server's rule would pick
    dim, layers, chain = SHAPES[args.shapes]
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    if args.configs:
        configs = [tuple(int(n) for n in c.split("x")) for c in args.configs.split(",")]
        return sweep(sglang, ours, args, configs, dtype)
    failed = False
    for budget in (int(b) for b in args.budgets.split(",")):
        for ready in (False, True):
            equal, same = same_as_sglang(sglang, ours, dim, args.requests, budget + 1, args.device, dtype,
                                         args.equal, parents_ready=ready)
            failed |= not equal or same != args.equal
            print(f"budget {budget}, {args.requests} requests, {dtype}{', parents ready' if ready else ''}: "
                  f"{'equal' if equal else 'DIFFERENT'} to SGLang's; {same}/{args.equal} replays the same")
    if args.no_timing or failed:
        return int(failed)
    base = median_ms(sglang, Case(dim, args.requests, chain, False, args.device, dtype, 0), args.device, args.repeats)
    print(f"{args.shapes}: {dim} channels, {args.requests} requests; one layer's call, median of {args.repeats}; "
          f"a round = x {layers} layers")
    print(f"  chain of {chain} (DFLASH's verify, SGLang's kernel): {base * 1e3:.1f} us, a round {base * layers:.3f} ms")
    for budget in (int(b) for b in args.budgets.split(",")):
        case = Case(dim, args.requests, budget + 1, True, args.device, dtype, budget)
        theirs, first = (median_ms(k, case.clone(), args.device, args.repeats) for k in (sglang, ours))
        later_case = case.clone()
        later_case.call(ours)  # the first layer's parents
        later = median_ms(functools.partial(ours, parents_ready=True), later_case, args.device, args.repeats)
        mine = (first + (layers - 1) * later) / layers  # a layer's share of a round
        print(f"  tree of {budget + 1} (budget {budget}): SGLang {theirs * 1e3:.1f} us ({theirs / base:.2f}x the "
              f"chain); ours {first * 1e3:.1f} us the first layer, {later * 1e3:.1f} us a later one ({mine / base:.2f}x "
              f"the chain a layer; {theirs / mine:.2f}x faster), a round {theirs * layers:.3f} -> {mine * layers:.3f} "
              f"ms; a DDTREE server takes "
              f"{'ours' if module.tree_conv_pays(args.requests, dim, budget + 1) else 'SGLang'}'s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
