"""Baselines: earlier acceptance numbers to hold a bench against, and the comparison with tolerances.

A baseline file is either JSON in the bench's schema (an earlier `ddtree-deploy bench`, or the offline
decode tool `overlays/ddtree/tools/ddtree_cpu_decode.py --json`), whose variants name themselves, or
the text z-lab's dflash `benchmark.py` prints, which holds one run and is named on the command line
(`FILE=dflash`, the default, or `FILE=64` for DDTREE at budget 64). From that text two lines are read
(z-lab/dflash, dflash/benchmark.py, `_print_decode_summary`):

    Average Acceptance length: 7.79
    Acceptance length histogram: ['0.0%', '3.1%', ..., '41.2%']

The mean is over requests of each request's mean acceptance length (bonus token included); the
histogram has one entry per b = 0..block_size over all rounds (b = 0 never occurs and is dropped),
printed by rich, which may wrap the list over several lines.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError

from ddtree_deploy.benchmark.results import Acceptance, BenchResults, total_variation
from ddtree_deploy.errors import UsageError

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_MEAN = re.compile(r"Average Acceptance length:\s*([0-9.]+)")
_HISTOGRAM = re.compile(r"Acceptance length histogram:\s*\[([^\]]*)\]", re.S)
_PERCENT = re.compile(r"([0-9]+(?:\.[0-9]*)?)%")


class Baseline(BaseModel):
    """One baseline file, read: acceptance per variant, and per greedy request where the file has them."""

    path: str
    source: str
    acceptance: dict[str, Acceptance]
    requests: dict[str, dict[str, float]] = Field(
        default_factory=dict, description="variant -> prompt (as JSON text) -> mean acceptance, greedy batch 1")


class BaselineRow(BaseModel):
    baseline: str
    variant: str
    measured: bool
    ours: float | None = None
    theirs: float
    accept_diff: float | None = Field(default=None, description="ours - theirs (mean acceptance length)")
    tv: float | None = Field(default=None, description="total-variation distance of the histograms")
    differing_requests: list[int] = Field(default_factory=list,
                                          description="greedy prompts whose mean acceptance differs (same prompts)")
    ok: bool


class Comparison(BaseModel):
    max_accept_diff: float
    max_tv: float
    rows: list[BaselineRow]
    ok: bool
    message: str


def parse_spec(spec: str) -> tuple[Path, str | None]:
    """`FILE` or `FILE=VARIANT` (`dflash`, `ddtree@64` or `64`)."""
    path, eq, label = spec.rpartition("=") if "=" in spec else (spec, "", "")
    if not eq:
        return Path(spec), None
    label = label.strip()
    return Path(path), f"ddtree@{label}" if label.isascii() and label.isdigit() else label.lower()


def read_baseline(spec: str) -> Baseline:
    """Read one `--baseline` argument; any problem is a one-line `UsageError` naming the file."""
    path, label = parse_spec(spec)
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        raise UsageError(f"{path}: cannot read the baseline: {exc.strerror or exc}",
                         hint="give a z-lab benchmark.py output or a bench JSON") from None
    if text.lstrip().startswith("{"):
        return _from_json(path, text, label)
    return _from_zlab(path, text, label or "dflash")


def _from_json(path: Path, text: str, label: str | None) -> Baseline:
    try:
        results = BenchResults.model_validate(json.loads(text))
    except (ValueError, ValidationError) as exc:
        first = exc.errors()[0] if isinstance(exc, ValidationError) else None
        where = f"field {'.'.join(str(p) for p in first['loc'])}: {first['msg']}" if first else str(exc)
        raise UsageError(f"{path}: not a bench JSON ({where})",
                         hint="write it with `ddtree-deploy bench` or ddtree_cpu_decode.py --json") from None
    acceptance = {v.variant: a for v in results.variants if (a := v.acceptance) is not None}
    if label is not None:
        acceptance = {k: a for k, a in acceptance.items() if k == label}
    if not acceptance:
        raise UsageError(f"{path}: no variant with acceptance numbers" + (f" named {label}" if label else ""),
                         hint="variants: " + ", ".join(v.variant for v in results.variants) or "none")
    return Baseline(path=str(path), source=results.source, acceptance=acceptance,
                    requests={name: _greedy_requests(results, name) for name in acceptance})


def _greedy_requests(results: BenchResults, name: str) -> dict[str, float]:
    variant = results.variant(name)
    run = variant.run("greedy", 1) if variant else None
    if run is None:
        return {}
    return {json.dumps(results.prompts[r.prompt]): m for r in run.requests
            if (m := r.mean_accept) is not None and r.prompt < len(results.prompts)}


def _from_zlab(path: Path, text: str, label: str) -> Baseline:
    text = _ANSI.sub("", text)
    means, histograms = _MEAN.findall(text), _HISTOGRAM.findall(text)
    if len(means) != 1 or len(histograms) != 1:
        found = f"{len(means)} 'Average Acceptance length' and {len(histograms)} 'Acceptance length histogram' lines"
        raise UsageError(f"{path}: expected one z-lab benchmark.py result, found {found}",
                         hint="give one run's output per --baseline (FILE=VARIANT names it)")
    shares = [float(x) / 100 for x in _PERCENT.findall(histograms[0])]
    if len(shares) < 2:
        raise UsageError(f"{path}: the acceptance histogram has no percentages", hint="is this benchmark.py output?")
    mean = float(means[0])
    return Baseline(path=str(path), source="z-lab benchmark.py",
                    acceptance={label: Acceptance(mean=mean, per_round=mean, histogram=shares[1:], rounds=0)})


def compare(ours: BenchResults, baselines: list[Baseline], max_accept_diff: float, max_tv: float) -> Comparison:
    """Per baseline variant: our mean minus theirs and the histograms' TV distance, against the tolerances."""
    rows = [_row(ours, b, name, theirs, max_accept_diff, max_tv)
            for b in baselines for name, theirs in b.acceptance.items()]
    measured = [r for r in rows if r.measured]
    failed = [r for r in measured if not r.ok]
    if not measured:
        message = "no baseline variant was measured: " + ", ".join(sorted({r.variant for r in rows}))
    elif failed:
        message = "; ".join(_why(r, max_accept_diff, max_tv) for r in failed)
    else:
        message = f"{len(measured)} variants within |diff| <= {max_accept_diff} and TV <= {max_tv}"
    return Comparison(max_accept_diff=max_accept_diff, max_tv=max_tv, rows=rows,
                      ok=bool(measured) and not failed, message=message)


def _row(ours: BenchResults, baseline: Baseline, name: str, theirs: Acceptance, max_diff: float,
         max_tv: float) -> BaselineRow:
    variant = ours.variant(name)
    mine = variant.acceptance if variant else None
    if mine is None:
        return BaselineRow(baseline=baseline.path, variant=name, measured=False, theirs=theirs.mean, ok=True)
    diff = mine.mean - theirs.mean
    tv = total_variation(mine.histogram, theirs.histogram) if mine.histogram and theirs.histogram else None
    ok = abs(diff) <= max_diff + 1e-9 and (tv is None or tv <= max_tv + 1e-9)
    return BaselineRow(baseline=baseline.path, variant=name, measured=True, ours=mine.mean, theirs=theirs.mean,
                       accept_diff=diff, tv=tv, differing_requests=_differing(ours, baseline, name), ok=ok)


def _differing(ours: BenchResults, baseline: Baseline, name: str) -> list[int]:
    theirs = baseline.requests.get(name) or {}
    mine = _greedy_requests(ours, name)
    index = {json.dumps(p): i for i, p in enumerate(ours.prompts)}
    return sorted(index[k] for k, m in mine.items() if k in theirs and abs(m - theirs[k]) > 1e-6)


def _why(row: BaselineRow, max_diff: float, max_tv: float) -> str:
    parts = []
    if row.accept_diff is not None and abs(row.accept_diff) > max_diff:
        parts.append(f"mean acceptance {row.ours:.3f} vs {row.theirs:.3f} (diff {row.accept_diff:+.3f}, "
                     f"allowed {max_diff})")
    if row.tv is not None and row.tv > max_tv:
        parts.append(f"histogram TV {row.tv:.3f} > {max_tv}")
    return f"{row.variant} against {row.baseline}: " + ", ".join(parts)
