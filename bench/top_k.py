"""Benchmark: the DDTree tree build's top-K (overlay ddtree_utils ``_ddtree_top_k``) against ways
to take it in fewer passes over the vocabulary, each replayed from a CUDA graph.

Run 26 (H100) put the top-K at 0.27 ms of the fused Triton build's 0.56 ms at budget 512, batch 1
(L = 15, V = 151936): the build's other half is the pop loop. The top-K orders by log-prob, then
token id, through one int64 key per vocabulary entry, so ``torch.topk``'s radix select runs over
64-bit keys. The variants:

- ``chunked C``: the same keys, split into C chunks of each row; the top-K of every chunk, then the
  top-K of those C x K candidates. The keys are unique, so the result is the same set in the same
  order, bit for bit (checked here before timing); the token is read back from the key's low bits.
- ``repaired``: a 32-bit select (the order-preserving int32 image of each float32 log-prob), then a
  repair of the one place it may differ, the entries equal to its K-th value: the smallest token ids
  among all of the row's entries with that value (a prefix count over the row), and a sort of the K
  results by the int64 key. The same result bit for bit (checked before timing).
- ``float32``: ``torch.topk`` of the float32 log-probs alone: the floor a 32-bit select reaches,
  NOT exact (ties at the cut or inside the top-K may come out in another order); timed, never used.

Run 26 (H200, docs/gpu-validation.md): the chunked top-K equal everywhere and slower (0.50-1.01x),
the float32 floor 1.83-2.35x faster than the reference: the way to a faster top-K is a 32-bit select
whose tie order is repaired, not chunks. ``repaired`` (added after run 26) has run only on the CPU.

    PYTHONPATH=/tmp/site python -m bench.top_k --device cuda --budgets 64 512 1024 --batch 1 8
"""

from __future__ import annotations

import argparse
import functools
import statistics
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

from bench.tree_build import DDTREE_UTILS, graph_replay, load_module

LOW_BITS = (1 << 32) - 1


def ordered_log_probs(draft_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 log-probs, their order-preserving int32 image), as ``_ddtree_top_k`` makes them."""
    log_probs = torch.log_softmax(draft_logits.float(), dim=-1) + 0.0
    bits = log_probs.view(torch.int32)
    return log_probs, torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def keys_of(ordered: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """int64 keys that order by log-prob, then by the smaller token id; low 32 bits ``LOW_BITS - token``."""
    return (ordered.to(torch.int64) << 32) + (LOW_BITS - tokens)


def vocabulary_keys(draft_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, the int64 key of every vocabulary entry)."""
    log_probs, ordered = ordered_log_probs(draft_logits)
    return log_probs, keys_of(ordered, torch.arange(draft_logits.shape[-1], device=draft_logits.device))


def chunked_top_k(draft_logits: torch.Tensor, k: int, chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``_ddtree_top_k``'s result through per-chunk top-Ks (needs k <= a chunk's width)."""
    log_probs, keys = vocabulary_keys(draft_logits)
    vocab = keys.shape[-1]
    width = -(-vocab // chunks)
    padded = torch.nn.functional.pad(keys, (0, chunks * width - vocab), value=torch.iinfo(torch.int64).min)
    best_of_chunks = padded.view(*keys.shape[:-1], chunks, width).topk(k, dim=-1).values
    best = best_of_chunks.flatten(-2).topk(k, dim=-1).values
    tokens = LOW_BITS - (best & LOW_BITS)
    return log_probs.gather(-1, tokens), tokens


def repaired_top_k(draft_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``_ddtree_top_k``'s result from a 32-bit select whose ties at the cut are repaired."""
    log_probs, ordered = ordered_log_probs(draft_logits)
    values, tokens = ordered.topk(k, dim=-1)
    cut = values[..., -1:]
    above = (values > cut).sum(-1, keepdim=True)  # the select's first `above` entries are right as a set
    at_cut = ordered == cut
    rank_at_cut = at_cut.cumsum(-1, dtype=torch.int32)  # 1-based, by token id
    wanted = at_cut & (rank_at_cut <= k - above)
    slots = torch.where(wanted, rank_at_cut - 1, k).to(torch.int64)
    ties = torch.zeros(*tokens.shape[:-1], k + 1, dtype=torch.int64, device=tokens.device)
    ties.scatter_(-1, slots, torch.arange(ordered.shape[-1], device=tokens.device).expand_as(slots))
    column = torch.arange(k, device=tokens.device)
    from_ties = ties.gather(-1, (column - above).clamp(min=0))
    chosen = torch.where(column < above, tokens, from_ties)
    keys = keys_of(ordered.gather(-1, chosen), chosen).sort(dim=-1, descending=True).values
    chosen = LOW_BITS - (keys & LOW_BITS)
    return log_probs.gather(-1, chosen), chosen


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


def same_as_reference(dd: ModuleType, logits: torch.Tensor, k: int, variant: Callable[..., tuple]) -> bool:
    want = dd._ddtree_top_k(logits, k)
    got = variant(logits, k)
    return all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


def draft_like_logits(bs: int, length: int, vocab: int, device: str) -> torch.Tensor:
    """bench/tree_build.py's logits (a confident head, a long flat tail), with exact ties planted at
    the head so the order among equal log-probs is exercised."""
    g = torch.Generator(device="cpu").manual_seed(0)
    logits = torch.randn(bs, length, vocab, generator=g) * 2.0
    logits[:, :, :8] += torch.rand(bs, length, 8, generator=g) * 12.0
    logits[:, :, vocab // 2: vocab // 2 + 4] = logits[:, :, :1]  # four copies of token 0's logit
    return logits.to(torch.bfloat16).to(device)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--budgets", type=int, nargs="+", default=[64, 512, 1024])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--length", type=int, default=15)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--chunks", type=int, nargs="+", default=[16, 64, 128])
    parser.add_argument("--repeats", type=int, default=51)
    parser.add_argument("--no-timing", action="store_true", help="the equality check only (no CUDA)")
    args = parser.parse_args(argv)
    dd = load_module("ddtree_utils_overlay", Path(DDTREE_UTILS))
    failed = False
    for bs in args.batch:
        logits = draft_like_logits(bs, args.length, args.vocab, args.device)
        for budget in args.budgets:
            k = min(budget, args.vocab)
            fits = [c for c in args.chunks if k <= args.vocab // c]
            same = {f"chunked {c}": same_as_reference(dd, logits, k, functools.partial(chunked_top_k, chunks=c))
                    for c in fits}
            same["repaired"] = same_as_reference(dd, logits, k, repaired_top_k)
            failed |= not all(same.values())
            line = f"bs {bs} budget {budget}: " + ", ".join(
                f"{name} {'equal' if ok else 'DIFFERENT'}" for name, ok in same.items())
            if not args.no_timing:
                ref = graphed_ms(functools.partial(dd._ddtree_top_k, k=k), logits, args.repeats)
                cells = [f"reference {ref * 1e3:.0f} us"]
                for c in fits:
                    ms = graphed_ms(functools.partial(chunked_top_k, k=k, chunks=c), logits, args.repeats)
                    cells.append(f"chunked {c} {ms * 1e3:.0f} us ({ref / ms:.2f}x)")
                ms = graphed_ms(functools.partial(repaired_top_k, k=k), logits, args.repeats)
                cells.append(f"repaired {ms * 1e3:.0f} us ({ref / ms:.2f}x)")
                ms = graphed_ms(functools.partial(float_top_k, k=k), logits, args.repeats)
                cells.append(f"float32 {ms * 1e3:.0f} us ({ref / ms:.2f}x)")
                line += "; " + "; ".join(cells)
            print(line, flush=True)
    return int(failed)


if __name__ == "__main__":
    raise SystemExit(main())
