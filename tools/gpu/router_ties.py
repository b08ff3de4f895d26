#!/usr/bin/env python3
"""Router near-ties at the splits of a speculative server's greedy outputs (issue 16).

usage: PYTHONPATH=/tmp/site router_ties.py MODEL_DIR REF.json CASE.json [--label L] [--out OUT.json] [--device D]

MODEL_DIR is a bf16 Qwen3NextForCausalLM (make_hybrid.py's hyb_rand); REF.json and CASE.json are
hybrid_client.py / ddtree_client.py results of a plain and a speculative server (their "single" and
"batch4" lists, paired as ddtree_compare.py pairs them). OUT defaults to CASE.router_ties.json.

The hypothesis under test: on an MoE target, DFLASH's greedy output splits from plain decoding at
tokens where the target's own top-2 logit gap is large, because the router's k-th and (k+1)-th
expert logits (k = num_experts_per_tok) nearly tie there, and plain decoding (1 token a forward) and
verification (a block a forward) compute them with different bf16 numerics, so they pick different
expert sets. For each split (output index `first`, the first output where REF and CASE differ) the
token that produced the split logits sits at sequence position p = len(prompt) + first - 1. With
transformers this tool reports, for every MoE layer at p:
- the router's k/k+1 logit gap in fp32 (the oracle), and in bf16 in two shapes: (a) one forward over
  prompt + common outputs (verify-like) and (b) the prompt's prefill, then the common outputs decoded
  one token a forward with the cache (decode shape), and whether (a) and (b) chose different expert
  sets there (and at which other output positions they did);
- the target's fp32 top-2 logit gap at p, and how far REF's token led CASE's there;
- for context, the fp32 router gaps at every non-split position of the same sequences (prompt +
  REF's whole output; min, 5th percentile, median, per layer and as the min over layers per
  position), and the share of non-split positions whose min gap is at most the split's: a split
  whose min router gap sits in the bottom few percent supports the hypothesis; one at the median
  refutes it.
What it cannot show: HF's kernels are not SGLang's (its MoE, GDN and attention kernels and CUDA
graphs), so a flip between (a) and (b) here neither proves nor is needed for SGLang's flip; the gap
statistic is the evidence. A split at output 0 comes from the prompt's prefill, the same shape on
both servers, so it is no decode-vs-verify flip and is marked as such.
Prints one line per split and a summary line ROUTER_TIES[LABEL].
"""
from __future__ import annotations

import argparse
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

MODES = ("single", "batch4")


@dataclass
class Split:
    mode: str
    index: int
    prompt: object
    prompt_ids: list[int]
    ref_out: list[int]
    first: int  # output index of the first difference
    case_token: int

    @property
    def position(self) -> int:
        """Sequence position of the token whose logits split."""
        return len(self.prompt_ids) + self.first - 1

    @property
    def prefix(self) -> list[int]:
        """prompt + common outputs: the tokens up to and including `position`."""
        return self.prompt_ids + self.ref_out[: self.first]


@dataclass
class Routes:
    """One MoE layer's router over a token range: raw logits (float32 copy) and the experts chosen."""
    logits: list[torch.Tensor] = field(default_factory=list)
    chosen: list[torch.Tensor] = field(default_factory=list)


def moe_gates(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """Layer index -> that layer's router (mlp.gate) for every MoE layer."""
    layers = model.model.layers  # type: ignore[union-attr]
    return {i: layer.mlp.gate for i, layer in enumerate(layers) if hasattr(layer.mlp, "experts")}


def record(model: torch.nn.Module, k: int) -> tuple[dict[int, Routes], Callable[[], None]]:
    """Hooks on every router. The logits are recomputed from the gate's input with its own F.linear
    (transformers 5.12's router returns softmax probabilities as its first output, 5.25's raw logits);
    the chosen experts are the router's own indices when it returns them."""
    routes: dict[int, Routes] = {}
    handles = []
    for i, gate in moe_gates(model).items():
        routes[i] = r = Routes()

        def hook(mod: torch.nn.Module, args: tuple, out: object, r: Routes = r) -> None:
            x = args[0]
            logits = F.linear(x.reshape(-1, x.shape[-1]), mod.weight).float()
            if isinstance(out, tuple) and len(out) >= 3:
                chosen = out[2].reshape(-1, out[2].shape[-1])
            else:
                chosen = logits.topk(k, dim=-1).indices
            r.logits.append(logits.cpu())
            r.chosen.append(chosen.cpu())

        handles.append(gate.register_forward_hook(hook))

    def remove() -> None:
        for h in handles:
            h.remove()
    return routes, remove


def cat(routes: dict[int, Routes]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    return {i: (torch.cat(r.logits), torch.cat(r.chosen)) for i, r in routes.items()}


def run(model: torch.nn.Module, k: int, prompt: list[int], decoded: list[int] | None
        ) -> tuple[torch.Tensor, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """decoded None: one forward over `prompt`. Else prefill `prompt`, then each of `decoded` one
    forward at a time with the cache. Returns the logits of every position [T, V] (float32, CPU) and
    each MoE layer's (router logits [T, E], chosen experts [T, k])."""
    dev = next(model.parameters()).device
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    routes, remove = record(model, k)
    try:
        with torch.no_grad():
            out = model(input_ids=torch.tensor([prompt], device=dev), use_cache=decoded is not None)
            logits = [out.logits[0].float().cpu()]
            for t in decoded or []:
                cache = getattr(out, "cache", None)
                cache = out.past_key_values if cache is None else cache
                out = model(input_ids=torch.tensor([[t]], device=dev), use_cache=True, **{cache_kw: cache})
                logits.append(out.logits[0].float().cpu())
    finally:
        remove()
    return torch.cat(logits), cat(routes)


def gaps(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The k-th minus the (k+1)-th largest logit of every row."""
    s = logits.sort(dim=-1, descending=True).values
    return s[:, k - 1] - s[:, k]


def same_sets(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.sort(dim=-1).values == b.sort(dim=-1).values).all(dim=-1)


def stats(xs: list[float]) -> dict[str, float | int | None]:
    if not xs:
        return {"n": 0, "min": None, "p5": None, "median": None}
    t = torch.tensor(xs, dtype=torch.float64)
    return {"n": len(xs), "min": round(float(t.min()), 5), "p5": round(float(t.quantile(0.05)), 5),
            "median": round(float(t.quantile(0.5)), 5)}


def find_splits(ref: dict, case: dict, encode: Callable[[str], list[int]] | None) -> tuple[list[Split], int, int]:
    """Every (mode, index) whose greedy outputs differ; also how many were identical, of how many."""
    splits, same, total = [], 0, 0
    for mode in MODES:
        for i, (x, y) in enumerate(zip(ref.get(mode, []), case.get(mode, []), strict=True)):
            a, b = x.get("output_ids"), y.get("output_ids")
            if a is None or b is None:
                continue
            total += 1
            first = next((j for j, (p, q) in enumerate(zip(a, b, strict=False)) if p != q), None)
            if first is None:
                same += a == b  # a shorter output (an early stop) is no split at a token either
                continue
            p = x["prompt"]
            if isinstance(p, str):
                if encode is None:
                    raise SystemExit("text prompts need the model dir's tokenizer")
                ids = encode(p)
                n = x.get("meta", {}).get("prompt_tokens")
                if n is not None and n != len(ids):
                    print(f"  skip {mode}[{i}] {p!r}: {len(ids)} tokens here, the server saw {n}")
                    continue
            else:
                ids = list(p)
            splits.append(Split(mode, i, p, ids, list(a), first, b[first]))
    return splits, same, total


def analyse(bf16: torch.nn.Module, fp32: torch.nn.Module, ref: dict, case: dict,
            encode: Callable[[str], list[int]] | None = None) -> dict:
    k, n_exp = bf16.config.num_experts_per_tok, bf16.config.num_experts
    if k >= n_exp:
        raise SystemExit(f"top-{k} of {n_exp} experts: every expert is used, there is no router decision to flip")
    splits, same, total = find_splits(ref, case, encode)
    layers = sorted(moe_gates(bf16))
    pooled: dict[tuple[int, ...], list[float]] = {}  # token prefix -> per-layer fp32 gaps at its last token
    split_keys: set[tuple[int, ...]] = set()
    rows = []
    for s in splits:
        p = s.position
        seq = s.prompt_ids + s.ref_out
        logits32, r32 = run(fp32, k, seq, None)  # the oracle, over REF's whole output
        g32 = {i: gaps(r32[i][0], k) for i in layers}
        for j in range(len(seq)):
            pooled[tuple(seq[: j + 1])] = [float(g32[i][j]) for i in layers]
        split_keys.add(tuple(s.prefix))
        la, ra = run(bf16, k, s.prefix, None)  # (a) verify-like: one forward
        decoded = s.ref_out[: s.first]
        lb, rb = run(bf16, k, s.prompt_ids, decoded) if decoded else (la, ra)  # (b) decode shape
        router, flips = [], []
        for i in layers:
            flip = ~same_sets(ra[i][1], rb[i][1])
            flips += [[j, i] for j in range(len(s.prompt_ids), p + 1) if bool(flip[j]) and j != p]
            router.append({
                "layer": i, "gap_fp32": round(float(g32[i][p]), 5),
                "gap_bf16_prefix": round(float(gaps(ra[i][0][p:p + 1], k)[0]), 5),
                "gap_bf16_incremental": round(float(gaps(rb[i][0][p:p + 1], k)[0]), 5),
                "set_fp32": sorted(r32[i][1][p].tolist()), "set_bf16_prefix": sorted(ra[i][1][p].tolist()),
                "set_bf16_incremental": sorted(rb[i][1][p].tolist()), "flip": bool(flip[p])})
        top = logits32[p].topk(2)
        low = min(router, key=lambda r: r["gap_fp32"])
        rows.append({
            "mode": s.mode, "index": s.index, "prompt": s.prompt, "prompt_len": len(s.prompt_ids),
            "first": s.first, "position": p, "prefill": s.first == 0,
            "ref_token": s.ref_out[s.first], "case_token": s.case_token,
            "target_top2": [[round(float(v), 4), int(t)] for v, t in zip(top.values, top.indices, strict=True)],
            "target_gap_fp32": round(float(top.values[0] - top.values[1]), 4),
            "ref_minus_case_fp32": round(float(logits32[p, s.ref_out[s.first]] - logits32[p, s.case_token]), 4),
            "hf_argmax_bf16_prefix": int(la[p].argmax()), "hf_argmax_bf16_incremental": int(lb[p].argmax()),
            "router": router, "min_gap_fp32": low["gap_fp32"], "min_gap_layer": low["layer"],
            "flips_elsewhere": flips})
    rest = [g for key, g in pooled.items() if key not in split_keys]
    mins = [min(g) for g in rest]
    for row in rows:
        row["share_nonsplit_at_or_below"] = (round(sum(m <= row["min_gap_fp32"] for m in mins) / len(mins), 4)
                                             if mins else None)
    return {"top_k": k, "num_experts": n_exp, "moe_layers": layers, "identical": same, "total": total,
            "splits": rows,
            "nonsplit": {"positions": len(rest), "position_min_gap": stats(mins),
                         "layer_gap": {str(i): stats([g[n] for g in rest]) for n, i in enumerate(layers)}}}


def line(r: dict) -> str:
    gaps_ = " ".join(f"L{x['layer']}:{x['gap_fp32']:.4f}" for x in r["router"])
    flips = [x["layer"] for x in r["router"] if x["flip"]]
    return (f"  {r['mode']:6s} {str(r['prompt'])[:30]!r:33s} first_diff={r['first']} pos={r['position']}"
            f"{' (prefill)' if r['prefill'] else ''} ref={r['ref_token']} case={r['case_token']}"
            f" target_gap={r['target_gap_fp32']} ref-case={r['ref_minus_case_fp32']}"
            f" router_gap_fp32[{gaps_}] min={r['min_gap_fp32']:.4f}@L{r['min_gap_layer']}"
            f" share_nonsplit<=min={r['share_nonsplit_at_or_below']}"
            f" bf16_prefix_vs_incremental_flip={flips or 'none'} flips_elsewhere={len(r['flips_elsewhere'])}"
            f" hf_argmax(prefix,incr)=({r['hf_argmax_bf16_prefix']},{r['hf_argmax_bf16_incremental']})")


def summary(res: dict, label: str) -> str:
    rows = [r for r in res["splits"] if not r["prefill"]]
    ns = res["nonsplit"]["position_min_gap"]
    low = sum(ns["p5"] is not None and r["min_gap_fp32"] <= ns["p5"] for r in rows)
    med = stats([r["min_gap_fp32"] for r in rows])["median"]
    return (f"ROUTER_TIES[{label}] {res['identical']}/{res['total']} identical; {len(res['splits'])} splits "
            f"({len(res['splits']) - len(rows)} at output 0); min-over-layers router gap at decode splits: median {med}, "
            f"{low}/{len(rows)} at or below the non-split 5th percentile; non-split positions "
            f"({ns['n']}): min {ns['min']} p5 {ns['p5']} median {ns['median']}; "
            f"HF bf16 prefix-vs-incremental flips at the split: {sum(any(x['flip'] for x in r['router']) for r in rows)}/{len(rows)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("ref")
    ap.add_argument("case")
    ap.add_argument("--label", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ref, case = (json.load(open(f)) for f in (a.ref, a.case))
    models = [AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=d).to(a.device).eval()
              for d in (torch.bfloat16, torch.float32)]

    def encode(text: str) -> list[int]:  # only text prompts need the tokenizer
        return list(AutoTokenizer.from_pretrained(a.model_dir).encode(text))

    res = analyse(*models, ref, case, encode=encode)
    label = a.label or f"{Path(a.ref).stem} vs {Path(a.case).stem}"
    res.update(model=a.model_dir, ref=a.ref, case=a.case, device=str(a.device))
    for r in res["splits"]:
        print(line(r))
    print(summary(res, label))
    out = a.out or str(Path(a.case).with_suffix(".router_ties.json"))
    json.dump(res, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
