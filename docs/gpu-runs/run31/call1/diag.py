"""Scratch diagnosis (not part of the repo): where rc.20's top-K and pop loop spend their time."""
import sys, statistics, torch, importlib.util, re
sys.path.insert(0, '.')
from bench.tree_build import load_version_pair, NEWEST, graph_replay

def ms(fn, repeats=31):
    replay = graph_replay(lambda static, _: fn(static), X, 0)
    t = []
    for _ in range(repeats):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); replay(); e.record(); e.synchronize(); t.append(s.elapsed_time(e))
    return statistics.median(t) * 1e3

core, kernel = load_version_pair("ddtree@0.3.0-rc.20")
from bench.tree_build import TritonBuilder, check_triton_same, heap_build
builders = {v: TritonBuilder.of(f"ddtree@0.3.0-{v}") for v in ("rc.20", "rc.21", "rc.22")}
g1 = torch.Generator(device="cpu").manual_seed(0)
for bs in (1, 8):
    logits = torch.randn(bs, 15, 151936, generator=g1) * 2.0
    logits[:, :, :8] += torch.rand(bs, 15, 8, generator=g1) * 12.0
    X = logits.to(torch.bfloat16).cuda()
    for budget in (64, 512, 1024):
        for v, b in builders.items():
            check_triton_same(b, X, budget)
        times = {v: ms(lambda x, b=b: b.build(x, budget)) for v, b in builders.items()}
        tops = {v: ms(lambda x, b=b: b.top_k(x, budget)) for v, b in builders.items()}
        print(f"build bs {bs} budget {budget} (equal to each version's torch builder): " + ", ".join(f"{v} {t:.1f} us (top-K {tops[v]:.1f})" for v, t in times.items()), flush=True)
core21, kernel21 = load_version_pair("ddtree@0.3.0-rc.21")
g0 = torch.Generator(device="cpu").manual_seed(0)
for bs in (1, 8):
    logits = torch.randn(bs, 15, 151936, generator=g0) * 2.0
    logits[:, :, :8] += torch.rand(bs, 15, 8, generator=g0) * 12.0
    X = logits.to(torch.bfloat16).cuda()
    for budget in (64, 512, 1024):
        a, b = core._ddtree_top_k(X, budget), core21._ddtree_top_k(X, budget)
        same = torch.equal(a[1], b[1]) and torch.equal(a[0].view(torch.int32), b[0].view(torch.int32))
        t20 = ms(lambda x: core._ddtree_top_k(x, budget)); t21 = ms(lambda x: core21._ddtree_top_k(x, budget))
        print(f"top-K bs {bs} k {budget}: rc.20 {t20:.1f} us, rc.21 {t21:.1f} us ({t20 / t21:.2f}x), same {same}", flush=True)
g = torch.Generator(device="cpu").manual_seed(0)
for bs in (1, 8):
    logits = torch.randn(bs, 15, 151936, generator=g) * 2.0
    logits[:, :, :8] += torch.rand(bs, 15, 8, generator=g) * 12.0
    X = logits.to(torch.bfloat16).cuda()
    f = X.float(); lp = torch.log_softmax(f, -1) + 0.0; bits = lp.view(torch.int32); ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    parts = {
        "float()": lambda x: x.float(),
        "log_softmax(float)": lambda x: torch.log_softmax(x.float(), -1),
        "log_softmax(bf16, dtype=f32)": lambda x: torch.log_softmax(x, -1, dtype=torch.float32),
        "+0.0 on f32": lambda x: lp + 0.0,
        "where images": lambda x: torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits),
        "images+radix (k=512)": lambda x: kernel.ddtree_top_k_triton(log_probs=lp, ordered=ordered, k=512),
        "torch.topk int32 k=512": lambda x: ordered.topk(512, dim=-1, sorted=False),
        "whole _ddtree_top_k 512": lambda x: core._ddtree_top_k(x, 512),
        "logsumexp f32": lambda x: torch.logsumexp(f, -1),
        "rc.20 ddtree_log_probs_triton": lambda x: kernel.ddtree_log_probs_triton(x),
        "torch.zeros hist-like": lambda x: torch.zeros((4, 15, 256), dtype=torch.int32, device=x.device),
        "amax f32": lambda x: f.amax(-1),
    }
    for name, fn in parts.items():
        print(f"bs {bs} {name}: {ms(fn):.1f} us", flush=True)
    top, ids = core._ddtree_top_k(X, 512)
    for budget in (64, 512):
        t, i = top[..., :budget].contiguous(), ids[..., :budget].contiguous()
        for w in (1, 4):
            print(f"bs {bs} pop loop + visibility budget {budget} {w}w: {ms(lambda x: kernel.build_ddtree_trees_triton(log_probs=t, top_tokens=i, budget=budget, num_warps=w)):.1f} us", flush=True)
        print(f"bs {bs} pop loop + visibility budget {budget} 4w plain reductions: {ms(lambda x: kernel.build_ddtree_trees_triton(log_probs=t, top_tokens=i, budget=budget, num_warps=4, one_reduction=False)):.1f} us", flush=True)

# pop-loop variants: the kernel source edited (timing only; trees not checked)
from pathlib import Path
src = Path(kernel.__file__).read_text()
variants = {
    "no loads": [("tl.load(row + rank, mask=valid, other=0.0)", "(-1.0 + 0.0 * rank)"),
                 ("tl.load(row + rank + 1, mask=has_next, other=neg_inf)", "(-2.0 + 0.0 * rank)"),
                 ("tl.load(row0 + depth * k, mask=has_child, other=neg_inf)", "(-0.5 + 0.0 * depth)"),
                 ("tl.load(top_tokens + (depth - 1) * k + rank, mask=valid, other=0)", "rank")],
    "no stores": [("mask=live)", "mask=live & (node < 0))")],
    "no token load": [("tl.load(top_tokens + (depth - 1) * k + rank, mask=valid, other=0)", "rank")],
    "L1 warm": [("    tl.store(parents_out, -1)\n", "    tl.store(parents_out, -1)\n    warm = 0.0\n    for d in range(depth_limit):\n        warm += tl.sum(tl.load(row0 + d * k + slot, mask=slot < k, other=0.0).to(tl.float64), axis=0)\n    tl.store(scores_out, warm, mask=warm == 12345.0)\n")],
    "no visibility": [("    _ddtree_visibility_kernel[", "    if False: _ddtree_visibility_kernel[")],
    "cache .ca": [("mask=valid, other=0.0)", "mask=valid, other=0.0, cache_modifier='.ca')"),
                  ("mask=has_next, other=neg_inf)", "mask=has_next, other=neg_inf, cache_modifier='.ca')"),
                  ("mask=has_child, other=neg_inf)", "mask=has_child, other=neg_inf, cache_modifier='.ca')")],
}
for name, edits in variants.items():
    text = src
    for a, b in edits:
        assert a in text, (name, a)
        text = text.replace(a, b)
    tag = re.sub(r"\W", "_", name); path = Path(f"/tmp/variant_{tag}.py"); path.write_text(text)
    spec = importlib.util.spec_from_file_location(path.stem, path); mod = importlib.util.module_from_spec(spec); sys.modules[path.stem] = mod; spec.loader.exec_module(mod)
    for bs in (1,):
        logits = torch.randn(bs, 15, 151936, generator=g) * 2.0
        logits[:, :, :8] += torch.rand(bs, 15, 8, generator=g) * 12.0
        X = logits.to(torch.bfloat16).cuda()
        top, ids = core._ddtree_top_k(X, 512)
        print(f"variant {name} bs {bs} budget 512 4w: {ms(lambda x: mod.build_ddtree_trees_triton(log_probs=top, top_tokens=ids, budget=512, num_warps=4)):.1f} us", flush=True)

