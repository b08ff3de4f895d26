"""What `bench` does after the playbook: the results folder (JSON, table, plots), the baseline verdict, rendering."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel

from ddtree_deploy import output as out
from ddtree_deploy.benchmark.baseline import Baseline, Comparison, compare
from ddtree_deploy.benchmark.results import BenchResults
from ddtree_deploy.fleet import FleetReport
from ddtree_deploy.playbook import PlaybookReport

JSON_FILE, TABLE_FILE = "bench.json", "bench.md"


class BenchReport(BaseModel):
    """What `bench --json` prints: the playbook's report, the files written and the baseline verdict."""

    command: str = "bench"
    report: FleetReport[PlaybookReport]
    results_dir: str
    files: list[str]
    plots_skipped: str | None = None
    comparison: Comparison | None = None


def results_of(report: FleetReport[PlaybookReport]) -> BenchResults | None:
    """The bench step's results (partial ones from a failed step's details), if it got that far."""
    for row in report.hosts:
        for outcome in row.result.steps if row.result else []:
            if outcome.step == "bench" and outcome.details.get("bench"):
                return BenchResults.model_validate(outcome.details["bench"])
    return None


def finish(report: FleetReport[PlaybookReport], folder: Path, baselines: list[Baseline], max_diff: float,
            max_tv: float, as_json: bool) -> None:
    from ddtree_deploy.commands._play import exit_code

    found = results_of(report)
    comparison = compare(found, baselines, max_diff, max_tv) if found is not None and baselines else None
    files, skipped = _write(found, comparison, folder) if found is not None else ([], "no results")
    code = exit_code(report)
    if comparison is not None and not comparison.ok:
        code = max(code, out.ExitCode.FAILED)
    summary = BenchReport(report=report, results_dir=str(folder), files=[str(f) for f in files],
                          plots_skipped=skipped, comparison=comparison)
    out.emit(summary, as_json=as_json, human=_render, code=code)


def _write(results: BenchResults, comparison: Comparison | None, folder: Path) -> tuple[list[Path], str | None]:
    from ddtree_deploy.benchmark.table import markdown

    files = [folder / JSON_FILE, folder / TABLE_FILE]
    files[0].write_text(results.model_dump_json(indent=1, by_alias=True) + "\n")
    files[1].write_text(markdown(results, comparison))
    try:
        from ddtree_deploy.benchmark.plots import plot

        return files + plot(results, folder), None
    except ImportError:
        return files, "matplotlib is not installed (pip install 'ddtree-deploy[bench]')"


def _render(summary: BenchReport) -> None:
    from ddtree_deploy.commands._play import render

    render(summary.report)
    for path in summary.files:
        out.console.print(f"  wrote {path}", soft_wrap=True, markup=False)
    if summary.plots_skipped:
        out.console.print(f"  plots skipped: {summary.plots_skipped}", soft_wrap=True, markup=False)
    table = Path(summary.results_dir) / TABLE_FILE
    if table.is_file() and summary.files:
        out.console.print(table.read_text(), markup=False, highlight=False, soft_wrap=True)
    comparison = summary.comparison
    if comparison is not None:
        colour = "green" if comparison.ok else "bold red"
        out.console.print(f"baseline: [{colour}]{'pass' if comparison.ok else 'FAIL'}[/] ({comparison.message})",
                          soft_wrap=True)
