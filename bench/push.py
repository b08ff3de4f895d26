"""Benchmark: `push` and `rollback` over 4 hosts behind real sshd, beside Ansible doing the same job (goal: >= 8x).

Four loopback hosts per tool (ct129, ct200, ct129b, ct200b: sandbox trees with the real sglang 0.5.17
files, each behind its own sshd, reached through ssh_config aliases) run the stand-in server; each tool
gets its own four, identical, so neither changes what the other finds. In one run:

* ddtree-deploy (`python -m ddtree_deploy.cli ... --json`, a subprocess per command): `push --all`
  then `rollback --all`, twice: a cold round (the first snapshot copies the package into the empty
  store) and a warm round (the store already holds every content: iterating on an overlay). Both
  include restart, health wait and probes. Then the same two rounds with an inventory without
  service blocks (files only, issue 3's measure) and a fresh state folder.
* Ansible (ansible-core's `ansible-playbook`, forks 4, pipelining, ControlPersist as shipped, no fact
  gathering, the interpreter set per host): the same job as an expert would write it. Push = `tar`
  the installed package and its dist-info, `copy` the overlay's new files and pip's RECORD listing
  them (made on the controller), `patch -p1` its patch set (one command, the diffs on stdin),
  restart the server (SIGTERM to its process group, SIGKILL after a grace, start detached), `uri`
  health with retries every 0.25 s. Rollback = remove the package and untar the archive (exact: files
  the overlay added are gone), restart, health. Files only: no restart.

ddtree_deploy is byte-compiled first, as an installed copy is (Ansible runs from its wheel's bytecode).
Every run must succeed (exit 0, every host `ok`) and leave the package as expected: every file of
sglang/ and its dist-info (path, mode, size; content for the files the overlay touches) as in the
pristine tree after a rollback and as ddtree-deploy's cold push left it after a push (for Ansible
too), and the server reporting the expected speculative algorithm. Ratios are Ansible seconds / ddtree-deploy seconds, measured in this run, with
the rounds of the two tools interleaved (see `measure`) and each one's load average printed beside it.
Usage, from the repo root: `python -m bench.push [--overlay ddtree@0.2.2] [--repeat N] [--keep]`
(`--repeat N`: every round N times, cold ones on emptied stores; the report gives medians and each
repetition's ratio).
"""

from __future__ import annotations

import argparse
import compileall
import hashlib
import importlib.metadata
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from ddtree_deploy.catalog import load_overlay
from ddtree_deploy.overlay import export
from ddtree_deploy.patching import apply_patch
from ddtree_deploy.record import record_path, updated_record
from sandbox.fleet import STANDIN, free_port, host_entry
from sandbox.hosts import SGLANG_VERSION, SandboxHost, build_host, package_files

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "integration"))
from sshd_fleet import Fleet, make_key, require_sshd, start_sshd  # noqa: E402

from bench.push_ansible import ansible, ansible_project, close_ssh_masters  # noqa: E402
from bench.push_model import ANSIBLE, CLI_TIMEOUT_S, DDTREE, GOAL, HOSTS, Bench, Timing  # noqa: E402

# ---------------------------------------------------------------- the fleet


def start_hosts(folder: Path) -> Fleet:
    """Build the four host trees and start one sshd per host; the caller stops the fleet."""
    require_sshd()
    folder.mkdir(parents=True)
    fleet = Fleet(
        folder=folder,
        client_key=make_key(folder / "client_ed25519", "ddtree-deploy bench client"),
        hosts={},
        servers={},
        ssh_config=folder / "ssh_config",
        known_hosts=folder / "known_hosts",
    )
    try:
        for name, profile in HOSTS.items():
            fleet.hosts[name] = build_host(folder / "hosts" / name, profile, name=name)
            fleet.servers[name] = start_sshd(name, fleet.hosts[name], folder / "sshd" / name, fleet.client_key)
    except BaseException:
        fleet.stop()
        raise
    fleet.known_hosts.write_text("".join(s.known_hosts_line() for s in fleet.servers.values()))
    fleet.write_ssh_config(fleet.ssh_config)
    return fleet


def service_entries(fleet: Fleet, ports: dict[str, int], cache: Path) -> dict[str, dict[str, Any]]:
    """Each host's service block, probes and PATH as the sandbox fleet has them, reached over ssh.

    The stand-in byte-compiles the package at start, caching results by content; one cache shared by
    all hosts (warmed before timing) makes every start compile only what changed, for both tools.
    """
    entries = {}
    for name, host in fleet.hosts.items():
        entry = host_entry(host, ports[name], ["--standin-compile-cache", str(cache)])
        entries[name] = {**entry, "transport": "ssh"}
    return entries


def files_only_entries(fleet: Fleet) -> dict[str, dict[str, Any]]:
    return {
        name: {"env": {"PATH": f"{host.bin_dir}:/usr/local/bin:/usr/bin:/bin"}} for name, host in fleet.hosts.items()
    }


def warm_compile_cache(entry: dict[str, Any]) -> float:
    started = time.monotonic()
    service = entry["service"]
    subprocess.run([*service["command"], *service["args"], "--standin-compile-only"], check=True, capture_output=True)
    return time.monotonic() - started


def warm_pushed_tree(bench: Bench, cache: Path, pushed: dict[str, bytes]) -> float:
    """Warm the compile cache for the package as the push leaves it (`pushed`), on a scratch copy.

    Without this the first server start on the overlay's modules compiles them, on four hosts at
    once: ddtree-deploy's cold push, which runs first, paid ~0.8 s for it and Ansible's found them cached.
    """
    started = time.monotonic()
    host = next(iter(bench.hosts[DDTREE].values()))
    scratch = bench.root / "pushed-tree"
    for part in ["sglang", *(p.name for p in host.package_root.glob("sglang-*.dist-info"))]:
        shutil.copytree(host.package_root / part, scratch / part, symlinks=True)
    for relative, content in pushed.items():
        (scratch / relative).parent.mkdir(parents=True, exist_ok=True)
        (scratch / relative).write_bytes(content)
    subprocess.run(
        [
            str(host.python),
            str(STANDIN),
            "--standin-compile-only",
            "--package-root",
            str(scratch),
            "--standin-compile-cache",
            str(cache),
        ],
        check=True,
        capture_output=True,
    )
    shutil.rmtree(scratch)
    return time.monotonic() - started


def compile_ddtree_deploy() -> float:
    """Byte-compile ddtree_deploy into its __pycache__, as `pip install` does for an installed package.

    This checkout is an editable install and the team's machines set PYTHONDONTWRITEBYTECODE, so
    without this every timed CLI run would compile ddtree-deploy's ~4,600 lines from source (~0.07 s of
    CPU), which an installed copy never does; Ansible, installed from its wheel, runs from bytecode.
    """
    started = time.monotonic()
    if not compileall.compile_dir(REPO / "ddtree_deploy", quiet=1):
        raise SystemExit("ddtree_deploy does not byte-compile")
    return time.monotonic() - started


def package_digest(host: SandboxHost, touched: list[str]) -> str:
    """sha256 over the path, mode and size of every file of sglang/ and its dist-info, and the content of
    each file the overlay touches (bytecode caches aside): a file added, left behind or patched differs."""
    h = hashlib.sha256()
    root = host.package_root
    for path in package_files(root):
        st = path.lstat()
        h.update(f"{path.relative_to(root)}\0{st.st_mode}\0{st.st_size}\n".encode())
    for relative in touched:
        path = root / relative
        h.update(path.read_bytes() if path.exists() else b"\0absent\0")
    return h.hexdigest()


def server_algorithm(port: int) -> str | None:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=5) as answer:
        return json.load(answer).get("speculative_algorithm")  # type: ignore[no-any-return]


def stop_standins(folder: Path) -> list[int]:
    """Kill the process groups of stand-in servers serving hosts under `folder` (a safety net; found by pid)."""
    killed = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(STANDIN).encode() in argv and any(str(folder).encode() in arg for arg in argv):
            try:
                os.killpg(os.getpgid(int(entry.name)), signal.SIGKILL)
                killed.append(int(entry.name))
            except ProcessLookupError:
                pass
    return killed


# ---------------------------------------------------------------- ddtree-deploy


def ddtree(bench: Bench, inventory: Path, label: str, *args: str) -> Timing:
    """Run one CLI command on every host; fail loudly unless it exits 0 with every host `ok`."""
    env = {**bench.env, "DDTREE_INVENTORY": str(inventory)}
    argv = [sys.executable, "-m", "ddtree_deploy.cli", *args, "--all", "--json"]
    started = time.monotonic()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=CLI_TIMEOUT_S, check=False)
    seconds = time.monotonic() - started
    try:
        rows = json.loads(proc.stdout)["data"]["hosts"]
    except (ValueError, KeyError, TypeError):
        raise SystemExit(
            f"{' '.join(args)}: exit {proc.returncode}, not a data envelope:\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        ) from None
    outcomes = {row["host"]: (row.get("result") or {}).get("outcome") for row in rows}
    if proc.returncode != 0 or set(outcomes.values()) != {"ok"} or len(rows) != len(HOSTS):
        raise SystemExit(
            f"{' '.join(args)}: exit {proc.returncode}, outcomes {outcomes}\n"
            + "\n".join(why_not_ok(row) for row in rows if outcomes[row["host"]] != "ok")
        )
    steps: dict[str, float] = {}
    for row in rows:
        for step in row["result"]["steps"]:
            steps[step["step"]] = max(steps.get(step["step"], 0.0), step.get("duration_s") or 0.0)
    return Timing(tool=DDTREE, op=label, seconds=seconds, steps_s=steps)


def why_not_ok(row: dict[str, Any]) -> str:
    result = row.get("result") or {}
    brief = {
        "error": row.get("error"),
        "outcome": result.get("outcome"),
        "failed_step": result.get("failed_step"),
        "reason": result.get("reason"),
        "steps": [(s["step"], s["status"], s.get("message")) for s in result.get("steps", [])],
    }
    return f"  {row['host']}: {json.dumps(brief)[:3000]}"


# ---------------------------------------------------------------- the package as the push leaves it


def pushed_contents(bench: Bench, host: SandboxHost) -> dict[str, bytes]:
    """Every file the push writes, as it leaves them on `host`: the new files, the patched ones, and pip's
    RECORD listing them (made with the function ddtree-deploy's plan uses)."""
    contents = {p: (bench.overlay_dir / "files" / p).read_bytes() for p in bench.new_files}
    for relative in bench.patched:
        diff = bench.overlay_dir / "patches" / SGLANG_VERSION / f"{relative}.diff"
        patched, conflicts = apply_patch(diff, relative, (host.package_root / relative).read_bytes())
        if patched is None:
            raise SystemExit(f"{diff} does not apply: {conflicts}")
        contents[relative] = patched
    record = record_path(SGLANG_VERSION)
    contents[record] = updated_record((host.package_root / record).read_bytes(), contents)
    return contents


# ---------------------------------------------------------------- runs and checks


class Expect(BaseModel):
    """The package digests each host must show and, when servers run, the speculative algorithm they report."""

    digests: dict[str, str]
    serving: bool
    algorithm: str | None = None


def check(bench: Bench, timing: Timing, expect: Expect) -> Timing:
    if digests(bench, timing.tool) != expect.digests:
        raise SystemExit(f"{timing.tool} {timing.op}: a package is not in the expected state")
    for name in bench.hosts[timing.tool]:
        if expect.serving and server_algorithm(bench.ports[timing.tool][name]) != expect.algorithm:
            raise SystemExit(f"{timing.tool} {timing.op}: {name}'s server does not run {expect.algorithm}")
    timing.load_1m = os.getloadavg()[0]
    print(
        f"  {timing.tool:13s} {timing.op:28s} {timing.seconds:6.2f}s  load {timing.load_1m:4.1f}  "
        "every host as expected",
        flush=True,
    )
    return timing


def speculative_algorithm(server_args: list[str]) -> str | None:
    """What the server reports as `speculative_algorithm` when started with the overlay's args (None: not set)."""
    flag = "--speculative-algorithm"
    return server_args[server_args.index(flag) + 1] if flag in server_args else None


def digests(bench: Bench, tool: str) -> dict[str, str]:
    touched = [*bench.new_files, *bench.patched, record_path(SGLANG_VERSION)]
    return {name: package_digest(host, touched) for name, host in bench.hosts[tool].items()}


Runner = Callable[[str, str], Timing]  # (push | rollback, label) -> timing


def rounds(run: Runner, bench: Bench, labels: list[str], pushed: Expect, pristine: Expect) -> list[Timing]:
    """push then rollback under each label, each checked against the expected package and server."""
    done = []
    for label in labels:
        done.append(check(bench, run("push", f"push ({label})"), pushed))
        done.append(check(bench, run("rollback", f"rollback ({label})"), pristine))
    return done


def ddtree_runner(bench: Bench, inventory: Path) -> Runner:
    def run(op: str, label: str) -> Timing:
        return ddtree(bench, inventory, label, op, *(["--overlay", bench.overlay] if op == "push" else []))

    return run


def measure(bench: Bench, say: Callable[[str], None], repeats: int = 1) -> list[Timing]:
    """Every timed round, `repeats` times over. The order pairs each ddtree-deploy round with an adjacent
    Ansible one, mirrored (full: D A A D, files only: A D D A), so a load that drifts over the run (2 shared
    cores) favours neither. Each tool works on its own four hosts (identical trees), so neither one's runs
    change what the other finds: Ansible's rollback rewrites every file of the package, which on shared
    hosts would make ddtree-deploy's next drift check re-hash the whole package, a cost no real fleet pays
    between pushes. Before each repetition after the first, ddtree-deploy's stores are emptied, so its
    cold rounds are cold again."""
    pristine = digests(bench, DDTREE)
    if digests(bench, ANSIBLE) != pristine:
        raise SystemExit("the two tools' hosts do not start from the same package")
    ddtree(bench, bench.inventory, "start", "restart")  # servers run before a push, as on the real hosts
    timings: list[Timing] = []
    for repeat in range(repeats):
        if repeat:
            say(f"repetition {repeat + 1} of {repeats}: ddtree-deploy's stores emptied ({empty_stores(bench)} hosts)")
        timings += one_repetition(bench, pristine, first=not repeat)
    ddtree(bench, bench.inventory, "stop", "stop")
    ansible(bench, "stop", "stop")
    say("all rounds done")
    return timings


def one_repetition(bench: Bench, pristine: dict[str, str], first: bool) -> list[Timing]:
    full_d, files_d = ddtree_runner(bench, bench.inventory), ddtree_runner(bench, bench.files_inventory)

    def full_a(op: str, label: str) -> Timing:
        return ansible(bench, op, label)

    def files_a(op: str, label: str) -> Timing:
        return ansible(bench, f"{op}_files", label)

    cold = full_d("push", "push (cold)")
    pushed = digests(bench, DDTREE)
    if pushed == pristine:
        raise SystemExit("the push changed no package")
    algorithm = speculative_algorithm(bench.server_args)
    serving = (Expect(digests=pushed, serving=True, algorithm=algorithm), Expect(digests=pristine, serving=True))
    files = (Expect(digests=pushed, serving=False), Expect(digests=pristine, serving=False))
    timings = [check(bench, cold, serving[0]), check(bench, full_d("rollback", "rollback (cold)"), serving[1])]
    if first:
        ansible(bench, "prepare", "prepare")  # untimed, as ddtree-deploy's first restart
        ansible(bench, "start", "start")
    timings += rounds(full_a, bench, ["cold"], *serving)
    timings += rounds(files_a, bench, ["files only, cold"], *files)
    timings += rounds(files_d, bench, ["files only, cold", "files only, warm"], *files)
    timings += rounds(files_a, bench, ["files only, warm"], *files)
    timings += rounds(full_a, bench, ["warm"], *serving)
    timings += rounds(full_d, bench, ["warm"], *serving)
    return timings


def empty_stores(bench: Bench) -> int:
    """Make ddtree-deploy's hosts as its first cold push found them: no snapshot, no object, no state.json.

    Only between repetitions, after a rollback (nothing deployed); the server's own files (`server/`) stay.
    """
    emptied = 0
    for inventory in (bench.inventory, bench.files_inventory):
        for entry in yaml.safe_load(inventory.read_text())["hosts"].values():
            for env_dir in Path(entry["state_dir"]).iterdir():
                state = json.loads((env_dir / "state.json").read_text())
                if state.get("overlay") or (env_dir / "journal.json").exists():
                    raise SystemExit(f"{env_dir}: something is deployed; its store cannot be emptied")
                for name in ("objects", "snapshots"):
                    shutil.rmtree(env_dir / name)
                (env_dir / "state.json").unlink()
                emptied += 1
    return emptied


# ---------------------------------------------------------------- report


def table(timings: list[Timing]) -> list[dict[str, Any]]:
    """One row per operation: each tool's median seconds over the repetitions, their ratio (Ansible / ddtree-deploy),
    and the ratio of each repetition on its own (the n-th run of each tool, which ran side by side)."""
    by_op: dict[str, dict[str, list[float]]] = {}
    for t in timings:
        by_op.setdefault(t.op, {}).setdefault(t.tool, []).append(t.seconds)
    rows = []
    for op, seconds in by_op.items():
        ours, theirs = statistics.median(seconds[DDTREE]), statistics.median(seconds[ANSIBLE])
        rows.append(
            {
                "operation": op,
                "ddtree_deploy_s": round(ours, 2),
                "ansible_s": round(theirs, 2),
                "ratio": round(theirs / ours, 2),
                "meets_goal": theirs / ours >= GOAL,
                "each_ratio": [round(a / d, 2) for d, a in zip(seconds[DDTREE], seconds[ANSIBLE], strict=True)],
                "each_ddtree_deploy_s": [round(d, 2) for d in seconds[DDTREE]],
                "each_ansible_s": [round(a, 2) for a in seconds[ANSIBLE]],
            }
        )
    return rows


def print_report(timings: list[Timing]) -> list[dict[str, Any]]:
    rows = table(timings)
    repeats = len(rows[0]["each_ratio"])
    print("\ncold/warm: ddtree-deploy's store empty / already holding the package's contents; for Ansible, its first")
    print("and second round (it archives the whole package on every push either way)")
    if repeats > 1:
        print(
            f"seconds: the median of {repeats} repetitions; ratio: of the medians; each: every repetition's own ratio"
        )
    print(f"{'operation':32s} {'ddtree-deploy s':>15s} {'Ansible s':>10s} {'ratio':>7s}  target >= {GOAL:.0f}x")
    for r in rows:
        verdict = "met" if r["meets_goal"] else "MISSED"
        each = f"  each: {', '.join(f'{x:.2f}x' for x in r['each_ratio'])}" if repeats > 1 else ""
        print(
            f"{r['operation']:32s} {r['ddtree_deploy_s']:15.2f} {r['ansible_s']:10.2f} {r['ratio']:6.2f}x  "
            f"{verdict}{each}"
        )
    print("\nwhere ddtree-deploy's time goes (each step: its slowest host, s; the rest is the CLI and connections)")
    for t in timings:
        if t.tool == DDTREE:
            steps = "  ".join(f"{k} {v:.2f}" for k, v in t.steps_s.items())
            print(f"  {t.op:30s} {t.seconds:6.2f}s  {steps}")
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--overlay", default="ddtree@0.2.2", help="NAME@VERSION under overlays/")
    parser.add_argument("--keep", action="store_true", help="keep the bench folder (printed) for inspection")
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="N",
        help="run every round N times (cold rounds with emptied stores); report medians",
    )
    opts = parser.parse_args(argv)
    began = time.monotonic()

    def say(message: str) -> None:
        print(f"[{time.monotonic() - began:6.1f}s] {message}", flush=True)

    folder = Path(tempfile.mkdtemp(prefix="ddtree-bench-push-"))
    fleets: list[Fleet] = []
    bench: Bench | None = None
    try:
        fleets.append(start_hosts(folder / "fleet"))
        fleets.append(start_hosts(folder / "fleet-ansible"))
        say(f"4 hosts for each tool built and their sshd started under {folder}")
        bench = setup(folder, fleets[0], fleets[1], opts.overlay, say)
        rows = print_report(measure(bench, say, opts.repeat))
        ansible_core = importlib.metadata.version("ansible-core")
        print(f"\nAnsible: ansible-core {ansible_core}")
        print(
            json.dumps(
                {
                    "bench": "push",
                    "overlay": opts.overlay,
                    "goal": GOAL,
                    "ansible_core": ansible_core,
                    "repeat": opts.repeat,
                    "rows": rows,
                }
            )
        )
        say("done")
    finally:
        killed = stop_standins(folder)
        if killed:
            print(f"stopped stand-in servers left running: {killed}")
        if bench is not None:
            close_ssh_masters(bench)
        for fleet in fleets:
            fleet.stop()
        if not opts.keep:
            subprocess.run(["rm", "-rf", "--", str(folder)], check=False)


def setup(folder: Path, fleet: Fleet, ansible_fleet: Fleet, overlay: str, say: Callable[[str], None]) -> Bench:
    """Inventories (with and without services), the warmed compile cache, and the Ansible project."""
    overlay_dir = folder / "overlay"  # the version exported whole (what it inherits resolved), as Ansible's role reads it
    export(load_overlay(overlay, REPO / "overlays"), overlay_dir)
    manifest = yaml.safe_load((overlay_dir / "overlay.yaml").read_text())
    ports = {tool: {name: free_port() for name in fleet.hosts} for tool in (DDTREE, ANSIBLE)}
    entries = service_entries(fleet, ports[DDTREE], folder / "compile-cache.json")
    inventory = fleet.write_inventory(folder / "inventory.yaml", hosts=entries)
    files_inventory = fleet.write_inventory(
        folder / "inventory-files.yaml", state_base=folder / "state-files", hosts=files_only_entries(fleet)
    )
    first = next(iter(fleet.hosts))
    say(f"stand-in compile cache warmed in {warm_compile_cache(entries[first]):.1f}s")
    say(f"ddtree_deploy byte-compiled in {compile_ddtree_deploy():.1f}s (as an installed copy is)")
    env = {
        **os.environ,
        "DDTREE_OVERLAYS": str(REPO / "overlays"),
        "DDTREE_AUDIT_LOG": str(folder / "audit.jsonl"),
    }
    bench = Bench(
        root=folder,
        overlay=overlay,
        overlay_dir=overlay_dir,
        server_args=manifest["server"]["args"],
        new_files=manifest["files"],
        patched=sorted(manifest["patches"][SGLANG_VERSION]),
        inventory=inventory,
        files_inventory=files_inventory,
        env=env,
        ansible_dir=folder / "ansible",
        hosts={DDTREE: fleet.hosts, ANSIBLE: ansible_fleet.hosts},
        ports=ports,
    )
    pushed = pushed_contents(bench, next(iter(ansible_fleet.hosts.values())))  # the hosts' trees are identical
    ansible_project(
        bench, ansible_fleet, service_entries(ansible_fleet, ports[ANSIBLE], folder / "compile-cache.json"), pushed
    )
    say(
        f"compile cache warmed for the pushed package too in {warm_pushed_tree(bench, folder / 'compile-cache.json', pushed):.1f}s"
    )
    return bench


if __name__ == "__main__":
    main()
