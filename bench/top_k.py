"""Benchmark: the DDTree tree build's top-K, overlay 0.1.0's ``_ddtree_top_k`` (one int64 key per
vocabulary entry: the log-prob's order-preserving image, then the token id) against the newest
version's (``bench.tree_build.NEWEST``), each replayed from a CUDA graph, with the float32 floor
beside them. The newest must equal the int64 key on its own log-probs (``key64_top_k``).

Run 26 (H100) put the top-K at 0.27 ms of the fused Triton build's 0.56 ms at budget 512, batch 1
(L = 15, V = 151936). ``torch.topk``'s radix select over 64-bit keys takes twice the passes of a
32-bit one. rc.16 takes, on CUDA, a select over the int32 image alone, which is right as a set except among
the entries equal to its K-th value; three Triton kernels (``ddtree_top_k_triton``) put the smallest
token ids at that value in their place and order the K by the int64 key. Columns: 0.1.0's, rc.16's
(its Triton path on CUDA, the int64 key on the CPU), and ``float32``: ``torch.topk`` of the float32
log-probs alone, the floor a 32-bit select reaches, NOT exact (ties in any order); timed, never used.

Run 26 (H200): a chunked int64 top-K (the top-K of every chunk, then of the candidates) was equal
and slower (0.50-1.01x); the float32 floor 1.83-2.35x faster than the reference. Run 28 (H100, `docs/gpu-runs/run28/call5/top_k.txt`): rc.16's Triton
path 1.45-1.65x the reference at batches 1-2 (15-30 rows), 1.67-1.80x at 4-8; the same select repaired
by torch ops instead (about 25 launches: a search over the ties' running count) ran at 0.81-0.85x at
batch 1 and 1.14-1.22x from batch 3 (calls 3-5), so it was dropped.

    PYTHONPATH=/tmp/site python -m bench.top_k --device cuda --budgets 64 512 --batch 1 2 4 8
"""

from __future__ import annotations

import argparse
import functools
import statistics
from collections.abc import Callable
from types import ModuleType

import torch

from bench.tree_build import DDTREE_UTILS, NEWEST, graph_replay, load_module, load_newest_pair


def float_top_k(draft_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The 32-bit floor: float32 log-probs' own top-K (ties in any order)."""
    log_probs = torch.log_softmax(draft_logits.float(), dim=-1)
    return log_probs.topk(k, dim=-1)


def graphed_ms(fn: Callable[[torch.Tensor], object], logits: torch.Tensor, repeats: int) -> float:
    """Median milliseconds of one CUDA-graph replay of ``fn(logits)`` (CUDA events)."""
    replay = graph_replay(lambda static, _: fn(static), logits, 0)
    assert replay is not None, "CUDA graph capture failed"
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()  # type: ignore[no-untyped-call]
        replay()
        end.record()  # type: ignore[no-untyped-call]
        end.synchronize()  # type: ignore[no-untyped-call]
        times.append(start.elapsed_time(end))  # type: ignore[no-untyped-call]
    return statistics.median(times)


def same_top_k(want: tuple[torch.Tensor, torch.Tensor], got: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Two (log-probs, tokens) equal, the log-probs bit for bit (a NaN row is equal to itself)."""
    return torch.equal(want[1], got[1]) and torch.equal(want[0].view(torch.int32), got[0].view(torch.int32))


def key64_top_k(core: ModuleType) -> Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]:
    """The exact top-K on ``core``'s own log-probs: one int64 key per entry (image, then the smaller id).
    (From rc.20 a version's log-probs are its own to the last bit, so 0.1.0's are not the reference.)"""

    def top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        log_probs, ordered = core._ddtree_log_probs_and_images(logits)
        tokens = core._ddtree_key64_tokens(ordered, k)
        return log_probs.gather(-1, tokens), tokens

    return top_k


def log_probs_gap(core: ModuleType, logits: torch.Tensor) -> tuple[int, int]:
    """``core``'s log-probs on ``logits``' device against its own torch path on the CPU: (the largest gap in
    units in the last place, how many entries differ), a NaN where the other is not counted as a gap of 2**31.
    From rc.20 both are the logit minus a float64 logsumexp, so a gap of one unit is a rounding boundary,
    and more is a wrong kernel."""
    got, _ = core._ddtree_log_probs_and_images(logits)
    want, _ = core._ddtree_log_probs_and_images(logits.cpu())
    got, nan = got.cpu(), want.isnan()
    gap = (got.view(torch.int32).long() - want.view(torch.int32).long()).abs()
    gap = torch.where(nan | got.isnan(), torch.where(nan == got.isnan(), 0, 1 << 31), gap)
    return int(gap.max()), int((gap > 0).sum())


def same_as_reference(reference: Callable[..., tuple], logits: torch.Tensor, k: int,
                      variant: Callable[..., tuple]) -> bool:
    return same_top_k(reference(logits, k), variant(logits, k))


def draft_like_logits(bs: int, length: int, vocab: int, device: str) -> torch.Tensor:
    """bench/tree_build.py's logits (a confident head, a long flat tail), with exact ties planted at
    the head so the order among equal log-probs is exercised."""
    g = torch.Generator(device="cpu").manual_seed(0)
    logits = torch.randn(bs, length, vocab, generator=g) * 2.0
    logits[:, :, :8] += torch.rand(bs, length, 8, generator=g) * 12.0
    logits[:, :, vocab // 2: vocab // 2 + 4] = logits[:, :, :1]  # four copies of token 0's logit
    return logits.to(torch.bfloat16).to(device)


def edge_cases_equal(reference: Callable[..., tuple], newest: Callable[..., tuple], device: str) -> bool:
    """The newest top-K equals the reference where the timed shapes do not go: a fully masked row (NaN
    log-probs), k of 1, not a power of two, the kernels' widest (1,024), one wider and the whole vocabulary."""
    logits = draft_like_logits(2, 3, 5000, device)
    logits[1, 2] = float("-inf")
    return all(same_as_reference(reference, logits, k, newest) for k in (1, 100, 1024, 1025, 5000))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--budgets", type=int, nargs="+", default=[64, 512, 1024])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--length", type=int, default=15)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--repeats", type=int, default=51)
    parser.add_argument("--no-timing", action="store_true", help="the equality check only (no CUDA)")
    args = parser.parse_args(argv)
    dd = load_module("ddtree_utils_overlay", DDTREE_UTILS)
    core, _ = load_newest_pair()
    reference = key64_top_k(core)
    variants = {NEWEST.rsplit("-", 1)[1]: core._ddtree_top_k}
    failed = not edge_cases_equal(reference, core._ddtree_top_k, args.device)
    print(f"edge cases (NaN row, k 1 / 100 / 1024 / 1025 / V): {NEWEST} {'DIFFERENT' if failed else 'equal'}")
    widest, differing = log_probs_gap(core, draft_like_logits(8, args.length, args.vocab, args.device))
    failed |= widest > 1
    print(f"log-probs on {args.device} against the CPU's torch path: {NEWEST} at most {widest} units in the last "
          f"place, {differing} entries differ{' (WRONG: more than a rounding boundary)' if widest > 1 else ''}")
    for bs in args.batch:
        logits = draft_like_logits(bs, args.length, args.vocab, args.device)
        for budget in args.budgets:
            k = min(budget, args.vocab)
            same = {name: same_as_reference(reference, logits, k, variant) for name, variant in variants.items()}
            failed |= not all(same.values())
            line = f"bs {bs} budget {budget}: {NEWEST} " + ", ".join(
                f"{name} {'equal' if ok else 'DIFFERENT'}" for name, ok in same.items())
            if not args.no_timing:
                ref = graphed_ms(functools.partial(dd._ddtree_top_k, k=k), logits, args.repeats)
                cells = [f"0.1.0 {ref * 1e3:.0f} us"]
                for name, variant in (*variants.items(), ("float32", float_top_k)):
                    ms = graphed_ms(functools.partial(variant, k=k), logits, args.repeats)
                    cells.append(f"{name} {ms * 1e3:.0f} us ({ref / ms:.2f}x)")
                line += "; " + "; ".join(cells)
            print(line, flush=True)
    return int(failed)


if __name__ == "__main__":
    raise SystemExit(main())
