"""`ddtree-deploy bench`: the `bench` playbook on one host, its results written to a folder, baselines checked.

Every input is checked before the host is touched: the budgets, the prompts file, each baseline
file and the results folder. The playbook does the measuring (steps `bench` and `relaunch`); this
command writes `bench.json`, `bench.md` and, with matplotlib (the `bench` extra), the PNG plots,
compares the results with the baselines, and exits 1 when a tolerance is exceeded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
import yaml
from pydantic import BaseModel, ValidationError

from ddtree_deploy import output as out
from ddtree_deploy.errors import UsageError

if TYPE_CHECKING:
    from ddtree_deploy.benchmark.baseline import Baseline, Comparison
    from ddtree_deploy.benchmark.results import BenchResults
    from ddtree_deploy.benchmark.sweep import BenchArgs
    from ddtree_deploy.fleet import FleetReport
    from ddtree_deploy.playbook import PlaybookReport

JSON_FILE, TABLE_FILE = "bench.json", "bench.md"


class BenchReport(BaseModel):
    """What `bench --json` prints: the playbook's report, the files written and the baseline verdict."""

    command: str = "bench"
    report: Any  # FleetReport[PlaybookReport]; Any keeps the models' imports out of the command's import
    results_dir: str
    files: list[str]
    plots_skipped: str | None = None
    comparison: Any = None  # Comparison | None


def bench(
    host: out.HostOption = None,
    budgets: Annotated[str, typer.Option("--budgets", metavar="B,B,...", help="DDTREE tree budgets.")]
    = "16,32,64,128,256,512,1024",
    prompts: Annotated[Path | None, typer.Option(
        "--prompts", metavar="FILE", help="JSON or YAML list of prompts (text or token-id lists), "
                                          "else one prompt per line; default: the pinned set.")] = None,
    batch: Annotated[int, typer.Option("--batch", min=1, help="The batch size measured besides 1.")] = 4,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=1)] = 128,
    seeds: Annotated[str, typer.Option("--seeds", metavar="S,S,...", help="Seeds of the sampled passes ('' none).")]
    = "0,1",
    temperature: Annotated[float, typer.Option("--temperature", help="Of the sampled passes.")] = 0.7,
    dflash: Annotated[bool, typer.Option("--dflash/--no-dflash", help="Measure DFLASH's chain too.")] = True,
    tree_stats: Annotated[bool, typer.Option(
        "--tree-stats/--no-tree-stats", help="One more start per budget with --speculative-ddtree-debug "
                                             "(tree size, depth, top-1 agreement).")] = True,
    baseline: Annotated[list[str] | None, typer.Option(
        "--baseline", metavar="FILE[=VARIANT]", help="z-lab benchmark.py output (VARIANT: dflash, the default, "
                                                     "or a budget) or a bench JSON; repeatable.")] = None,
    max_accept_diff: Annotated[float, typer.Option("--max-accept-diff", min=0)] = 0.1,
    max_tv: Annotated[float, typer.Option("--max-tv", min=0, help="Histograms' total-variation distance.")] = 0.05,
    results: Annotated[Path, typer.Option("--results", metavar="DIR", help="Folder for the results.")]
    = Path("bench-results"),
    inventory: out.InventoryOption = None,
    accept_new_host_key: out.AcceptNewHostKeyOption = False,
    as_json: out.JsonOption = False,
) -> None:
    """Sweep DDTREE budgets (with DFLASH and plain decoding as baselines) on one host, then put it back.

    Exit codes: 0 measured (and within the baselines' tolerances); 1 a step failed and the host was put
    back, or a baseline tolerance was exceeded; 2 bad input; 3 the host is left unhealthy.
    """
    from ddtree_deploy.benchmark.baseline import read_baseline
    from ddtree_deploy.benchmark.sweep import BenchArgs

    with out.errors_rendered(as_json):
        args = _bench_args(BenchArgs, budgets=_ints(budgets, "--budgets"), prompts=_prompts(prompts), batch=batch,
                           max_new_tokens=max_new_tokens, seeds=_ints(seeds, "--seeds", empty_ok=True),
                           temperature=temperature, dflash=dflash, tree_stats=tree_stats)
        baselines = [read_baseline(spec) for spec in baseline or []]
        _make_folder(results)
        report = _play(args, host, inventory, accept_new_host_key, as_json)
    _finish(report, results, baselines, max_accept_diff, max_tv, as_json)


def _ints(text: str, option: str, empty_ok: bool = False) -> list[int]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not all(p.isascii() and p.lstrip("-").isdigit() for p in parts) or (not parts and not empty_ok):
        raise UsageError(f"{option} {text!r}: expected comma-separated whole numbers", hint=f"e.g. {option} 16,64,256")
    return [int(p) for p in parts]


def _prompts(path: Path | None) -> list[Any] | None:
    if path is None:
        return None
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{path}: cannot read the prompts: {exc}", hint="give a readable text, JSON or YAML file") \
            from None
    if path.suffix in (".json", ".yaml", ".yml"):
        try:
            value = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
        except (ValueError, yaml.YAMLError) as exc:
            raise UsageError(f"{path}: not valid {path.suffix[1:].upper()}: {str(exc).splitlines()[0]}",
                             hint="a list of prompts") from None
        if not isinstance(value, list):
            raise UsageError(f"{path}: expected a list of prompts", hint="e.g. [\"def f(x):\", [1, 2, 3]]")
        return value
    return [line for line in text.splitlines() if line.strip()]


def _bench_args(model: type[BenchArgs], **values: Any) -> BenchArgs:
    fields = {k: v for k, v in values.items() if v is not None}
    try:
        return model(**fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise UsageError(f"bench option {where}: {first['msg']}", hint="see `ddtree-deploy bench --help`") from None


def _make_folder(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise UsageError(f"{folder}: cannot write the results there: {exc.strerror or exc}",
                         hint="give --results a folder you can write") from None


def _play(args: BenchArgs, host: list[str] | None, inventory: str | None, accept_new_host_key: bool,
          as_json: bool) -> FleetReport[PlaybookReport]:
    from ddtree_deploy.fleet import FleetOptions, connecting
    from ddtree_deploy.inventory import load_inventory, select_hosts

    inv = load_inventory(inventory)
    hosts = select_hosts(inv, names=host, groups=None, all_hosts=False)
    if len(hosts) != 1:
        raise UsageError("bench measures one host at a time", hint="give exactly one --host")
    spec = hosts[0].service
    if spec is not None and "--speculative-algorithm" in [a.partition("=")[0] for a in spec.args]:
        raise UsageError(f"{hosts[0].name}: the inventory's service args set --speculative-algorithm, so the "
                         "bench cannot start plain or DFLASH servers", hint="leave the algorithm to the overlay's "
                                                                            "server.args")
    options = FleetOptions(accept_new_host_key=accept_new_host_key)
    with connecting(inv, hosts, "bench", options) as started:
        from ddtree_deploy import playbook
        from ddtree_deploy.commands._play import run_playbook
        from ddtree_deploy.steps import RunOptions

        book = playbook.builtin("bench")
        for call in book.steps:
            if call.name == "bench":
                call.args = args
        return run_playbook(inv, hosts, book, RunOptions(), None, options, as_json=as_json, started=started)


def results_of(report: FleetReport[PlaybookReport]) -> BenchResults | None:
    """The bench step's results (partial ones from a failed step's details), if it got that far."""
    from ddtree_deploy.benchmark.results import BenchResults

    for row in report.hosts:
        for outcome in row.result.steps if row.result else []:
            if outcome.step == "bench" and outcome.details.get("bench"):
                return BenchResults.model_validate(outcome.details["bench"])
    return None


def _finish(report: FleetReport[PlaybookReport], folder: Path, baselines: list[Baseline], max_diff: float,
            max_tv: float, as_json: bool) -> None:
    from ddtree_deploy.benchmark.baseline import compare
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
