"""Scratch, run 40: rc.38's sorted-frontier pop loop against rc.37's reduction, the build alone (pop loop and
visibility) on one top-K's output, by CUDA events over graph replays (median of 31, all configurations interleaved
thrice), every tree checked equal to rc.37's; rc.38 at its rule's warps and at 1, 2, 4 and 8 warps, and with the
last phase 128 wide or no phases; batch 1 and 8, randn rows, budgets 64, 256, 512 and 1,024."""
import contextlib, sys, statistics, torch
from unittest import mock
sys.path.insert(0, '.')
from bench.tree_build import load_version_pair, graph_replay

def us(fn, repeats=31):
    replay = graph_replay(lambda static, _: fn(), torch.zeros(1, device="cuda"), 0)
    t = []
    for _ in range(repeats):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); replay(); e.record(); e.synchronize(); t.append(s.elapsed_time(e))
    return statistics.median(t) * 1e3

core, old = load_version_pair("ddtree@0.3.0-rc.37")
_, new = load_version_pair("ddtree@0.3.0-rc.38")
g = torch.Generator(device="cpu").manual_seed(0)
for bs in (1, 8):
    L = torch.randn(bs, 15, 151936, generator=g) * 2.0
    L[:, :, :8] += torch.rand(bs, 15, 8, generator=g) * 12.0
    X = L.to(torch.bfloat16).cuda()
    for budget in (64, 256, 512, 1024):
        top, ids = core._ddtree_top_k(X, budget)
        def make(kernel, warps=None, last=None):
            def run():
                with mock.patch.object(kernel, "_LAST_SLOTS", last) if last else contextlib.nullcontext():
                    return kernel.build_ddtree_trees_triton(log_probs=top, top_tokens=ids, budget=budget, num_warps=warps)
            return run
        build = {"rc.37": make(old), "rc.38": make(new)}
        for w in (1, 2, 4, 8):
            build[f"rc.38 {w}w"] = make(new, warps=w)
        build["rc.38 last 128"] = make(new, last=128)
        build["rc.38 no phases"] = make(new, last=1 << 15)
        outs = {name: fn() for name, fn in build.items()}
        same = all(all(torch.equal(a, b) for a, b in zip(outs["rc.37"], o)) for o in outs.values())
        t = {name: [] for name in build}
        for _ in range(3):
            for name in t:
                t[name].append(us(build[name]))
        m = {name: statistics.median(x) for name, x in t.items()}
        print(f"bs {bs} budget {budget}: " + ", ".join(f"{n} {m[n]:.1f} us ({m[n] / m['rc.37']:.3f}x)" for n in m)
              + f"; same {same}", flush=True)
