"""Benchmark: SGLang 0.5.17's GatedDeltaNet verify kernel in tree mode (DDTREE on a hybrid target)
against the same kernel on a chain (DFLASH's verify), at a real target's head shapes.

In tree mode ``fused_sigmoid_gating_delta_rule_update`` runs the verify's T = budget + 1 tokens one
after another, storing every node's state to ``intermediate_states_buffer`` and loading the parent's
back before each step (``fused_sigmoid_gating_recurrent.py`` ~149-300). A DFLASH verify is the same
kernel over the draft block (16 tokens for z-lab's drafters) with no parent loads. This times one
layer's call for each budget, scales it to the target's GDN layers, and reports the state bytes the
call moves and the ratio to the chain. The default shapes are Qwen3.6-27B's: 16 key heads and 48
value heads of 128 x 128, 48 GDN layers. Run 21 (docs/gpu-validation.md) says why this is the next
measurement; it needs no model.

    PYTHONPATH=/tmp/site python bench/gdn_tree_verify.py --device cuda    # the GPU machine
    PYTHONPATH=/tmp/site python bench/gdn_tree_verify.py --shapes copy-hybrid  # the tiny hybrid's
    ... --ddtree-kernel-file /tmp/site_dd/sglang/kernels/ops/speculative/ddtree_gdn.py  # rc.8's beside it
    python bench/gdn_tree_verify.py --kernel-file PATH --device cpu --small  # Triton's interpreter

Every kernel first checks its per-node states against a float32 recurrence along each
node's path (the first request, the first two value heads); the tree is a random one whose
parents come before their children, as DDTree's pop order gives them. Times are CUDA-event
medians of ``--repeats`` replays of a CUDA graph holding one call.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

KERNEL_MODULE = "sglang.kernels.ops.attention.fla.fused_sigmoid_gating_recurrent"


@dataclass(frozen=True)
class Shapes:
    requests: int = 1
    key_heads: int = 16
    value_heads: int = 48
    head_dim: int = 128
    layers: int = 48
    chain: int = 16  # DFLASH's verify width (the draft block)


SMALL = Shapes(requests=2, key_heads=1, value_heads=2, head_dim=16, layers=2, chain=8)
# make_hybrid.py's copy hybrid (5 GDN layers of 2 key and 4 value heads of 64) with its copy draft's
# block of 8: where run 21 measured DDTREE@64 at 0.86-0.96x DFLASH, so the two can be read together.
COPY_HYBRID = Shapes(key_heads=2, value_heads=4, head_dim=64, layers=5, chain=8)


def load_kernel(kernel_file: str | None) -> Callable[..., torch.Tensor]:
    """SGLang's ``fused_sigmoid_gating_delta_rule_update``, from the installed package or a file."""
    if kernel_file is None:
        module = importlib.import_module(KERNEL_MODULE)
    else:
        spec = importlib.util.spec_from_file_location("gdn_kernel", kernel_file)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module.fused_sigmoid_gating_delta_rule_update


def random_parents(width: int, max_depth: int, g: torch.Generator) -> list[int]:
    """A random tree of ``width`` nodes in an order where every parent comes first (node 0 is the
    root, parent -1), no deeper than ``max_depth``; recent nodes are likelier parents."""
    parents, depths = [-1], [0]
    for node in range(1, width):
        choices = [p for p in range(node) if depths[p] < max_depth]
        weights = torch.tensor([1.0 + p for p in choices])
        parent = choices[int(torch.multinomial(weights, 1, generator=g))]
        parents.append(parent)
        depths.append(depths[parent] + 1)
    return parents


def inputs(shapes: Shapes, width: int, device: str, dtype: torch.dtype, g: torch.Generator) -> dict[str, torch.Tensor]:
    n, h, hv, d = shapes.requests, shapes.key_heads, shapes.value_heads, shapes.head_dim

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=g) * scale).to(device=device, dtype=dtype)

    return {
        "q": rand(1, n * width, h, d), "k": rand(1, n * width, h, d), "v": rand(1, n * width, hv, d),
        "a": rand(n * width, hv), "b": rand(n * width, hv),
        "A_log": (torch.randn(hv, generator=g) * 0.3).to(device), "dt_bias": (torch.randn(hv, generator=g) * 0.3).to(device),
        "ssm_states": (torch.randn((n, hv, d, d), generator=g) * 0.1).to(device),
    }


def run_kernel(kernel: Callable[..., torch.Tensor], x: dict[str, torch.Tensor], width: int,
               parents: torch.Tensor | None, states: torch.Tensor) -> torch.Tensor:
    """One verify call as SGLang's Triton GDN backend makes it (``gdn_triton.py`` target_verify)."""
    n = x["ssm_states"].shape[0]
    device = x["q"].device
    slots = torch.arange(n, dtype=torch.int32, device=device)
    return kernel(
        A_log=x["A_log"], dt_bias=x["dt_bias"], q=x["q"], k=x["k"], v=x["v"], a=x["a"], b=x["b"],
        initial_state_source=x["ssm_states"], initial_state_indices=slots,
        cu_seqlens=torch.arange(0, n * width + 1, width, dtype=torch.int32, device=device),
        use_qk_l2norm_in_kernel=True, softplus_beta=1.0, softplus_threshold=20.0, is_kda=False,
        disable_state_update=True, intermediate_states_buffer=states, intermediate_state_indices=slots,
        cache_steps=width, retrieve_parent_token=parents,
    )


def reference_states(x: dict[str, torch.Tensor], parents: list[int], heads: int) -> torch.Tensor:
    """Float32 delta rule along each node's path for request 0: the state after each node,
    [width, heads, V, K] (the buffer's layout)."""
    hv_per_h = x["v"].shape[2] // x["q"].shape[2]
    out = []
    for node in range(len(parents)):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        per_head = []
        for hv in range(heads):
            state = x["ssm_states"][0, hv].float().t().clone()  # [K, V]
            for t in reversed(path):
                key = x["k"][0, t, hv // hv_per_h].float()
                k = key / torch.sqrt((key * key).sum() + 1e-6)  # the kernel's l2 norm
                g = -torch.exp(x["A_log"][hv].float()) * F.softplus(x["a"][t, hv].float() + x["dt_bias"][hv].float())
                beta = torch.sigmoid(x["b"][t, hv].float())
                state = state * torch.exp(g)
                v = (x["v"][0, t, hv].float() - k @ state) * beta
                state = state + torch.outer(k, v)
            per_head.append(state.t())  # the states, not the outputs: they are what the commit copies
        out.append(torch.stack(per_head))
    return torch.stack(out)


def verify_buffers(shapes: Shapes, width: int, parents: list[int] | None, device: str) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The verify's parent links (every request the same tree; None for a chain) and its per-node
    state buffer, as the hybrid backend hands them to the kernel."""
    links = None if parents is None else torch.tensor([parents] * shapes.requests, dtype=torch.int32, device=device).clamp(min=0)
    states = torch.zeros((shapes.requests, width, shapes.value_heads, shapes.head_dim, shapes.head_dim), device=device)
    return links, states


def state_error(kernel: Callable[..., torch.Tensor], shapes: Shapes, width: int, parents: list[int] | None,
                device: str, dtype: torch.dtype, seed: int, kernel_parents: list[int] | None = None) -> float:
    """Largest error of the kernel's per-node states (request 0, two heads) against the float32
    recurrence, relative to the states' size. ``kernel_parents`` hands the kernel other parents than
    the reference's (a planted fault, for the test)."""
    g = torch.Generator().manual_seed(seed)
    x = inputs(shapes, width, device, dtype, g)
    tree = parents if parents is not None else list(range(-1, width - 1))
    given = kernel_parents if kernel_parents is not None else tree
    links, states = verify_buffers(shapes, width, None if parents is None else given, device)
    run_kernel(kernel, x, width, links, states)
    heads = min(2, shapes.value_heads)
    want = reference_states(x, tree, heads)
    got = states[0, :, :heads].float().cpu()
    return float((got - want.cpu()).abs().max() / want.abs().max())


def ddtree_kernel(kernel_file: str) -> Callable[..., torch.Tensor]:
    """Overlay ddtree 0.3.0-rc.8's ``ddtree_gdn_tree_verify`` (its ``kernels/ops/speculative/ddtree_gdn.py``),
    called the way ``run_kernel`` calls SGLang's: the tree verify only."""
    spec = importlib.util.spec_from_file_location("ddtree_gdn", kernel_file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def verify(*, initial_state_source: torch.Tensor, initial_state_indices: torch.Tensor, cu_seqlens: torch.Tensor,
               intermediate_states_buffer: torch.Tensor, intermediate_state_indices: torch.Tensor,
               retrieve_parent_token: torch.Tensor, A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor,
               q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: torch.Tensor, **_: object) -> torch.Tensor:
        return module.ddtree_gdn_tree_verify(
            A_log, a, dt_bias, q, k, v, b, initial_state_source=initial_state_source,
            initial_state_indices=initial_state_indices, cu_seqlens=cu_seqlens,
            intermediate_states_buffer=intermediate_states_buffer, intermediate_state_indices=intermediate_state_indices,
            retrieve_parent_token=retrieve_parent_token)

    return verify


def time_case(kernel: Callable[..., torch.Tensor], shapes: Shapes, width: int, tree: bool, device: str,
              dtype: torch.dtype, repeats: int) -> float:
    """Median ms of one layer's verify call. On CUDA the call is replayed from a CUDA graph, as the
    server runs it, so the Python launch (about 0.15 ms for these kernels) is not timed."""
    g = torch.Generator().manual_seed(width)
    x = inputs(shapes, width, device, dtype, g)
    parents = random_parents(width, shapes.chain - 1, g) if tree else None
    links, states = verify_buffers(shapes, width, parents, device)
    call = lambda: run_kernel(kernel, x, width, links, states)  # noqa: E731
    call()  # compile
    if device == "cuda":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
        call = graph.replay  # noqa: E731
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            call()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def same_as_sglang(kernels: dict[str, Callable[..., torch.Tensor]], shapes: Shapes, width: int, device: str,
                   dtype: torch.dtype, state_dtype: torch.dtype, replays: int) -> tuple[bool, int]:
    """Whether rc.8's kernel gives SGLang's per-node states and outputs exactly (a different random
    tree per request), and in how many of ``replays`` further calls (replays of one CUDA graph on
    CUDA) it gave the same bytes again: a race between its programs would show as a change."""
    g = torch.Generator().manual_seed(width + 7)
    x = inputs(shapes, width, device, dtype, g)
    trees = [random_parents(width, shapes.chain - 1, g) for _ in range(shapes.requests)]
    links = torch.tensor(trees, dtype=torch.int32, device=device).clamp(min=0)
    shape = (shapes.requests, width, shapes.value_heads, shapes.head_dim, shapes.head_dim)
    states = {name: torch.zeros(shape, device=device, dtype=state_dtype) for name in kernels}
    outputs = {name: run_kernel(kernel, x, width, links, states[name]) for name, kernel in kernels.items()}
    equal = torch.equal(states["sglang"], states["ddtree"]) and torch.equal(outputs["sglang"], outputs["ddtree"])
    again = torch.zeros_like(states["ddtree"])
    call = lambda: run_kernel(kernels["ddtree"], x, width, links, again)  # noqa: E731
    if device == "cuda":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = call()
        call = lambda: (graph.replay(), replayed)[1]  # noqa: E731
    same = 0
    for _ in range(replays):
        again.zero_()
        out = call()
        same += int(torch.equal(again, states["ddtree"]) and torch.equal(out, outputs["ddtree"]))
    return equal, same


def check_equal(kernels: dict[str, Callable[..., torch.Tensor]], shapes: Shapes, budgets: list[int], device: str,
                dtype: torch.dtype, replays: int) -> int:
    """``--equal``: every budget, both state dtypes; the exit status (1 if anything differed)."""
    if "ddtree" not in kernels:
        raise SystemExit("gdn_tree_verify.py: --equal needs --ddtree-kernel-file (the kernel to check)")
    failed = False
    for budget in budgets:
        for state_dtype in (torch.float32, torch.bfloat16):
            equal, same = same_as_sglang(kernels, shapes, budget + 1, device, dtype, state_dtype, replays)
            failed |= not equal or same != replays
            print(f"budget {budget}, {shapes.requests} requests, {state_dtype} states: "
                  f"{'equal' if equal else 'DIFFERENT'} to SGLang's; {same}/{replays} replays the same")
    return int(failed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--kernel-file", help="the kernel's .py file (default: the installed sglang's)")
    parser.add_argument("--ddtree-kernel-file", help="also time rc.8's tree verify (its ddtree_gdn.py)")
    parser.add_argument("--budgets", default="16,32,64,128,256")
    parser.add_argument("--requests", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--shapes", choices=["qwen3.6-27b", "copy-hybrid"], default="qwen3.6-27b")
    parser.add_argument("--small", action="store_true", help="tiny shapes (Triton's interpreter on the CPU)")
    parser.add_argument("--equal", type=int, metavar="REPLAYS",
                        help="no timing: check rc.8's kernel against SGLang's bit for bit (float32 and bfloat16 "
                             "states) and over REPLAYS replays; exit 1 on any difference")
    args = parser.parse_args()
    kernels = {"sglang": load_kernel(args.kernel_file)}
    if args.ddtree_kernel_file:
        kernels["ddtree"] = ddtree_kernel(args.ddtree_kernel_file)
    base = {"qwen3.6-27b": Shapes(), "copy-hybrid": COPY_HYBRID}[args.shapes]
    shapes = SMALL if args.small else dataclasses.replace(base, requests=args.requests)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    budgets = [int(b) for b in args.budgets.split(",")]
    if args.equal is not None:
        raise SystemExit(check_equal(kernels, shapes, budgets, args.device, dtype, args.equal))
    check_width = min(budgets) + 1
    check_tree = random_parents(check_width, shapes.chain - 1, torch.Generator().manual_seed(1))
    for name, kernel in kernels.items():
        error = state_error(kernel, shapes, check_width, check_tree, args.device, dtype, 1)
        print(f"check {name}: tree states at budget {min(budgets)} against the float32 recurrence, "
              f"max relative error {error:.2e}")
    state_bytes = shapes.value_heads * shapes.head_dim * shapes.head_dim * 4 * shapes.requests
    chain = time_case(kernels["sglang"], shapes, shapes.chain, False, args.device, dtype, args.repeats)
    print(f"shapes {shapes}; one layer's call, median of {args.repeats}; a round = x {shapes.layers} layers")
    print(f"  chain of {shapes.chain} (DFLASH's verify, SGLang's kernel): {chain:.3f} ms, a round {chain * shapes.layers:.2f} ms")
    for budget in budgets:
        width = budget + 1
        moved = state_bytes * (2 * width - 1)  # SGLang's: every node's state stored, every parent's loaded
        for name, kernel in kernels.items():
            ms = time_case(kernel, shapes, width, True, args.device, dtype, args.repeats)
            print(f"  tree of {width} (budget {budget}), {name}: {ms:.3f} ms, a round {ms * shapes.layers:.2f} ms, "
                  f"{moved / ms / 1e6:.0f} GB/s of SGLang's state traffic, {ms / chain:.2f}x the chain")


if __name__ == "__main__":
    main()
