"""The bench's PNG plots (acceptance and tokens/s against the budget), when matplotlib is installed.

matplotlib is the optional `bench` extra (`pip install ddtree-deploy[bench]`); `plot()` raises
`ImportError` without it and the caller says the plots were skipped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ddtree_deploy.benchmark.results import BenchResults

ACCEPTANCE_PNG = "acceptance.png"
TOKENS_PNG = "tokens_per_s.png"


def plot(results: BenchResults, folder: Path) -> list[Path]:
    """Write the plots into `folder`; return their paths (none if no DDTREE budget was measured)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: never a display
    from matplotlib import pyplot as plt

    trees = sorted((v for v in results.variants if v.budget is not None), key=lambda v: v.budget or 0)
    if not trees:
        return []
    budgets = [float(v.budget or 0) for v in trees]
    nan = float("nan")  # a missing point leaves a gap
    dflash, plain = results.variant("dflash"), results.variant("plain")
    written = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(budgets, [v.acceptance.mean if v.acceptance else nan for v in trees], "o-", label="DDTREE (greedy)")
    if dflash is not None and dflash.acceptance is not None:
        ax.axhline(dflash.acceptance.mean, color="tab:red", ls="--", label=f"DFLASH {dflash.acceptance.mean:.2f}")
    _axes(ax, budgets, "mean acceptance length (tokens per round, bonus included)", results)
    written.append(_save(fig, folder / ACCEPTANCE_PNG, plt))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for batch in sorted({1, results.batch or 1}):
        runs = [v.run("greedy", batch) for v in trees]
        (line,) = ax.plot(budgets, [r.tokens_per_s if r else nan for r in runs], "o-", label=f"DDTREE, batch {batch}")
        for base, style in ((dflash, "--"), (plain, ":")):
            run = base.run("greedy", batch) if base else None
            if base is not None and run is not None:  # the batch's colour, the baseline's line style
                ax.axhline(run.tokens_per_s, ls=style, color=line.get_color(), label=f"{base.variant.upper()}, batch {batch}")
    _axes(ax, budgets, "tokens/s (greedy)", results)
    written.append(_save(fig, folder / TOKENS_PNG, plt))
    return written


def _axes(ax: Any, budgets: list[float], ylabel: str, results: BenchResults) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(budgets, labels=[str(int(b)) for b in budgets])
    ax.minorticks_off()
    ax.set_xlabel("tree budget (nodes)")
    ax.set_ylabel(ylabel)
    ax.set_title(f"{results.host or results.source}: {results.model or 'model ?'}", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)


def _save(fig: Any, path: Path, plt: Any) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
