"""Benchmark: how long `ddtree-deploy status --json` takes to start and answer for one `transport: local` host.

One sandbox host (ct129's tree with the real sglang 0.5.17 files) answers `status --json` from:

* this checkout;
* a baseline commit (default `ce269cc`, the last one with the fork server and the verb-only
  registration), checked out into a temporary `git worktree`, with its fork server OFF
  (`DDTREE_DEPLOY_FORKSERVER=0`: every run imports for itself, as this checkout's do) and, for
  reference, ON (a runtime folder of its own; an untimed first run leaves the server, and the bench
  waits until it serves, as bench/push did);
* `python -c pass`, the floor no CLI goes under.

Each run is a subprocess, timed by the wall clock; a second run of the same command under
`python -X importtime` gives the import time (the sum of its top-level imports; with the fork
server on, only what the client imports). Both trees are byte-compiled first, as an installed copy
is. Every repetition runs each variant once, in an order rotated per repetition, so a load that
drifts favours none; the report gives medians and the ratio of each variant to this checkout.
Usage, from the repo root: `python -m bench.start [--repeat N] [--baseline REV]`.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from sandbox.hosts import build_host

REPO = Path(__file__).resolve().parents[1]
BASELINE = "ce269cc"
SERVE_WAIT_S = 30.0


@dataclass
class Variant:
    """One way of running the command: which tree, with which environment, and what it measured."""

    name: str
    argv: list[str]
    env: dict[str, str]
    wall_s: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)  # user + system of the process (on a shared machine, steadier)
    import_s: list[float] = field(default_factory=list)


def cli_argv(inventory: Path) -> list[str]:
    return [sys.executable, "-m", "ddtree_deploy.cli", "status", "--json", "--inventory", str(inventory)]


def base_env(folder: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDTREE_")}
    return {**env, "DDTREE_AUDIT_LOG": str(folder / "audit.jsonl")}


def run_once(variant: Variant, cwd: Path) -> None:
    """One timed run (it must answer with one healthy row), then one run under -X importtime."""
    before, started = _children_cpu_s(), time.monotonic()
    proc = subprocess.run(variant.argv, env=variant.env, cwd=cwd, capture_output=True, text=True, check=False)
    variant.wall_s.append(time.monotonic() - started)
    variant.cpu_s.append(_children_cpu_s() - before)
    if variant.argv[-1] != "pass":
        rows = json.loads(proc.stdout)["data"]["hosts"] if proc.returncode == 0 else []
        if len(rows) != 1 or rows[0]["error"] is not None:
            raise SystemExit(f"{variant.name}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    timed = subprocess.run([variant.argv[0], "-X", "importtime", *variant.argv[1:]], env=variant.env, cwd=cwd,
                           capture_output=True, text=True, check=False)
    variant.import_s.append(top_level_import_s(timed.stderr))


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def top_level_import_s(report: str) -> float:
    """The sum of the cumulative times of top-level imports in an `-X importtime` report."""
    total_us = 0
    for line in report.splitlines():
        if line.startswith("import time:") and not line.startswith("import time: self"):
            _, cumulative, name = line.split("|")
            if not name[1:2].isspace():  # one space before a top-level name, more before nested ones
                total_us += int(cumulative)
    return total_us / 1e6


def wait_until_serving(runtime: Path) -> None:
    """Until the fork server that the untimed first run left behind says it serves."""
    folder = runtime / "ddtree-deploy"
    deadline = time.monotonic() + SERVE_WAIT_S
    while "serving as pid" not in "".join(p.read_text(errors="replace") for p in folder.glob("*.log")):
        if time.monotonic() > deadline:
            raise SystemExit(f"no fork server came up under {folder}")
        time.sleep(0.05)


def stop_fork_servers(runtime: Path) -> None:
    for lock in (runtime / "ddtree-deploy").glob("*.lock"):
        pid = lock.read_text().strip()
        if pid.isdigit():
            try:
                os.kill(int(pid), signal.SIGTERM)
            except ProcessLookupError:
                pass


def imports_from(variant: Variant, tree: Path, cwd: Path) -> None:
    """Refuse to measure a tree other than the one named (an editable install elsewhere could win)."""
    code = "import ddtree_deploy, sys; sys.stdout.write(ddtree_deploy.__file__)"
    found = subprocess.run([sys.executable, "-c", code], env=variant.env, cwd=cwd, capture_output=True, text=True,
                           check=True)
    if not Path(found.stdout).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"{variant.name}: imports ddtree_deploy from {found.stdout}, not from {tree}")


def variants(folder: Path, inventory: Path, baseline: Path, rev: str) -> list[Variant]:
    env = base_env(folder)
    runtime = folder / "runtime"
    runtime.mkdir(mode=0o700)
    return [
        Variant("this checkout", cli_argv(inventory), {**env, "PYTHONPATH": str(REPO)}),
        Variant(f"{rev}, fork server off", cli_argv(inventory),
                {**env, "PYTHONPATH": str(baseline), "DDTREE_DEPLOY_FORKSERVER": "0"}),
        Variant(f"{rev}, fork server on", cli_argv(inventory),
                {**env, "PYTHONPATH": str(baseline), "XDG_RUNTIME_DIR": str(runtime)}),
        Variant("python -c pass", [sys.executable, "-c", "pass"], env),
    ]


def measure(folder: Path, rev: str, repeats: int) -> list[Variant]:
    host = build_host(folder / "host", "ct129", name="local1")
    inventory = folder / "inventory.yaml"
    inventory.write_text(yaml.safe_dump({"hosts": {"local1": host.inventory_entry(transport="local")}}))
    baseline = folder / "baseline"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "--quiet", str(baseline), rev], check=True)
    try:
        for tree in (REPO, baseline):
            compileall.compile_dir(tree / "ddtree_deploy", quiet=1)
        runs = variants(folder, inventory, baseline, rev)
        for variant, tree in zip(runs[:3], (REPO, baseline, baseline), strict=True):
            imports_from(variant, tree, folder)
            run_once(variant, folder)  # untimed: warms caches and, with the fork server on, starts it
            variant.wall_s.clear()
            variant.cpu_s.clear()
            variant.import_s.clear()
        wait_until_serving(folder / "runtime")
        for repeat in range(repeats):
            for variant in runs[repeat % len(runs):] + runs[:repeat % len(runs)]:
                run_once(variant, folder)
        return runs
    finally:
        stop_fork_servers(folder / "runtime")
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(baseline)], check=False)


def report(runs: list[Variant], repeats: int) -> dict[str, object]:
    ours = statistics.median(runs[0].wall_s)
    print(f"load average at the end: {os.getloadavg()[0]:.1f} (2 shared cores)")
    ours_cpu = statistics.median(runs[0].cpu_s)
    print(f"{'variant':26s} {'wall ms':>8s} {'/ this':>7s} {'CPU ms':>7s} {'/ this':>7s} {'imports ms':>10s}"
          f"   (medians of {repeats})")
    rows = []
    for v in runs:
        wall, cpu, imports = (statistics.median(x) for x in (v.wall_s, v.cpu_s, v.import_s))
        rows.append({"variant": v.name, "wall_s": round(wall, 4), "cpu_s": round(cpu, 4), "import_s": round(imports, 4),
                     "wall_ratio_to_this": round(wall / ours, 3), "cpu_ratio_to_this": round(cpu / ours_cpu, 3),
                     "each_wall_s": [round(x, 4) for x in v.wall_s]})
        print(f"{v.name:26s} {wall * 1e3:8.0f} {wall / ours:6.2f}x {cpu * 1e3:7.0f} {cpu / ours_cpu:6.2f}x "
              f"{imports * 1e3:10.0f}")
    return {"bench": "start", "repeat": repeats, "rows": rows}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, metavar="N", help="runs of each variant (default 5)")
    parser.add_argument("--baseline", default=BASELINE, metavar="REV", help=f"commit to compare with ({BASELINE})")
    opts = parser.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="ddtree-bench-start-"))
    try:
        print(json.dumps(report(measure(folder, opts.baseline, opts.repeat), opts.repeat)))
    finally:
        subprocess.run(["rm", "-rf", "--", str(folder)], check=False)


if __name__ == "__main__":
    main()
