"""`ddtree-deploy bench`: the `bench` playbook on one host, its results written to a folder, baselines checked.

Every input is checked before the host is touched: the budgets, the prompts file, each baseline
file and the results folder. The playbook does the measuring (steps `bench` and `relaunch`); this
command writes `bench.json`, `bench.md` and, with matplotlib (the `bench` extra), the PNG plots,
compares the results with the baselines, and exits 1 when a tolerance is exceeded.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ddtree_deploy import output as out
from ddtree_deploy.commands._selection import Selection, fleet_command
from ddtree_deploy.divergence import DEFAULT_TIE_TOLERANCE

if TYPE_CHECKING:
    from ddtree_deploy.benchmark.sweep import BenchArgs
    from ddtree_deploy.fleet import FleetReport
    from ddtree_deploy.playbook import PlaybookReport


@fleet_command(only=("host", "inventory", "accept_new_host_key"))
def bench(
    selection: Selection,
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
    keep_going: Annotated[bool, typer.Option(
        "--keep-going", help="Measure every variant even after one is not lossless (the bench still exits 1, "
                             "after the last).")] = False,
    baseline: Annotated[list[str] | None, typer.Option(
        "--baseline", metavar="FILE[=VARIANT]", help="z-lab benchmark.py output (VARIANT: dflash, the default, "
                                                     "or a budget) or a bench JSON; repeatable.")] = None,
    max_accept_diff: Annotated[float, typer.Option("--max-accept-diff", min=0)] = 0.1,
    max_tv: Annotated[float, typer.Option("--max-tv", min=0, help="Histograms' total-variation distance.")] = 0.05,
    tie_tolerance: Annotated[float, typer.Option(
        "--tie-tolerance", min=0, metavar="NATS",
        help="A greedy answer may part from plain's to one of plain's best five tokens this close to its choice (bf16 "
             "rounding; each such split is listed); 0: identical answers only.")] = DEFAULT_TIE_TOLERANCE,
    results: Annotated[Path, typer.Option("--results", metavar="DIR", help="Folder for the results.")]
    = Path("bench-results"),
    as_json: out.JsonOption = False,
) -> None:
    """Sweep DDTREE budgets (with DFLASH and plain decoding as baselines) on one host, then put it back.

    Exit codes: 0 measured (and within the baselines' tolerances); 1 a step failed and the host was put
    back, or a baseline tolerance was exceeded; 2 bad input; 3 the host is left unhealthy.
    """
    from ddtree_deploy.benchmark.baseline import read_baseline
    from ddtree_deploy.benchmark.sweep import BenchArgs
    from ddtree_deploy.commands._bench_output import JSON_FILE, finish

    with out.errors_rendered(as_json):
        args = _bench_args(BenchArgs, budgets=_ints(budgets, "--budgets"), prompts=_prompts(prompts), batch=batch,
                           max_new_tokens=max_new_tokens, seeds=_ints(seeds, "--seeds", empty_ok=True),
                           temperature=temperature, dflash=dflash, tree_stats=tree_stats, keep_going=keep_going,
                           tie_tolerance=tie_tolerance, keep_json=str((results / JSON_FILE).resolve()))
        baselines = [read_baseline(spec) for spec in baseline or []]
        _make_folder(results)
        report = _play(args, selection, as_json)
    finish(report, results, baselines, max_accept_diff, max_tv, as_json)


def _ints(text: str, option: str, empty_ok: bool = False) -> list[int]:
    from ddtree_deploy.errors import UsageError

    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not all(p.isascii() and p.lstrip("-").isdigit() for p in parts) or (not parts and not empty_ok):
        raise UsageError(f"{option} {text!r}: expected comma-separated whole numbers", hint=f"e.g. {option} 16,64,256")
    return [int(p) for p in parts]


def _prompts(path: Path | None) -> list[Any] | None:
    import json

    import yaml

    from ddtree_deploy.errors import UsageError

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
    from pydantic import ValidationError

    from ddtree_deploy.errors import UsageError

    fields = {k: v for k, v in values.items() if v is not None}
    try:
        return model(**fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise UsageError(f"bench option {where}: {first['msg']}", hint="see `ddtree-deploy bench --help`") from None


def _make_folder(folder: Path) -> None:
    from ddtree_deploy.errors import UsageError

    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise UsageError(f"{folder}: cannot write the results there: {exc.strerror or exc}",
                         hint="give --results a folder you can write") from None


def _play(args: BenchArgs, selection: Selection, as_json: bool) -> FleetReport[PlaybookReport]:
    from ddtree_deploy.errors import UsageError
    from ddtree_deploy.fleet import connecting

    inv, hosts = selection.load()
    if len(hosts) != 1:
        raise UsageError("bench measures one host at a time", hint="give exactly one --host")
    spec = hosts[0].service
    if spec is not None and "--speculative-algorithm" in [a.partition("=")[0] for a in spec.args]:
        raise UsageError(f"{hosts[0].name}: the inventory's service args set --speculative-algorithm, so the "
                         "bench cannot start plain or DFLASH servers", hint="leave the algorithm to the overlay's "
                                                                            "server.args")
    options = selection.fleet_options()
    with connecting(inv, hosts, "bench", options) as started:
        from ddtree_deploy import playbook
        from ddtree_deploy.commands._play import run_playbook
        from ddtree_deploy.hostrun import RunOptions

        book = playbook.builtin("bench")
        for call in book.steps:
            if call.name == "bench":
                call.args = args
        return run_playbook(inv, hosts, book, RunOptions(), None, options, as_json=as_json, started=started)
