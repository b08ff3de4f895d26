"""README command 1: build a local sandbox fleet and tell the whole story with the real CLI.

status -> push the DDTree overlay to ct200 -> probes -> status -> push a deliberately broken
overlay -> fail fast and automatic rollback -> status healthy. Every step runs `ddtree-deploy`
itself (a subprocess, as a user would), against two `transport: local` hosts with stand-in servers.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.panel import Panel

from sandbox.fleet import REPO, build_fleet

console = Console(highlight=False)

STORY = [
    ("Start both stand-in servers (as they would already run on the fleet)", ["restart", "--all"], 0),
    ("Where the fleet stands", ["status"], 0),
    ("Push the DDTree overlay to ct200: preflight, plan, reference answers, snapshot, apply, restart, probes",
     ["push", "--host", "ct200"], 0),
    ("ct200 now runs ddtree; ct129 is untouched", ["status"], 0),
    ("Push a deliberately broken overlay: the server dies at start-up, push notices at once and rolls back",
     ["push", "--host", "ct200", "--overlay", "broken"], 1),
    ("ct200 is back on ddtree and healthy", ["status"], 0),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--root", type=Path, default=REPO / "sandbox-fleet", help="where the fleet is built")
    parser.add_argument("--stop", action="store_true", help="stop the stand-in servers at the end")
    args = parser.parse_args(argv)
    started = time.monotonic()
    inventory = _fresh_fleet(args.root)
    env = {**os.environ, **fleet_env(args.root)}
    failures = [title for title, cli_args, expected in STORY if _step(title, cli_args, expected, env) != expected]
    if args.stop:
        _stop_servers(env)
    console.rule()
    verdict = "[green]the story went as told[/]" if not failures else f"[red]unexpected: {failures}[/]"
    console.print(f"{verdict} in {time.monotonic() - started:.0f}s. Fleet: {inventory.parent}")
    console.print(_try_it(write_env_file(args.root), stopped=args.stop), soft_wrap=True, markup=False)
    return 1 if failures else 0


def fleet_env(root: Path) -> dict[str, str]:
    """The demo fleet's inventory, overlays and audit log (never the user's own)."""
    return {"DDTREE_INVENTORY": str(root / "inventory.yaml"), "DDTREE_OVERLAYS": str(root / "overlays"),
            "DDTREE_AUDIT_LOG": str(root / "audit.jsonl")}


def write_env_file(root: Path) -> Path:
    """`root/env.sh`: sourced, a shell works on the demo fleet with this python's `ddtree-deploy` first on PATH."""
    lines = [f"export {name}={shlex.quote(value)}" for name, value in fleet_env(root).items()]
    lines.append(f"export PATH={shlex.quote(str(Path(sys.executable).parent))}:\"$PATH\"")
    path = root / "env.sh"
    path.write_text("# The demo fleet (sandbox/demo.py): `. env.sh`, then `ddtree-deploy status`.\n" + "\n".join(lines) + "\n")
    return path


def _try_it(env_file: Path, stopped: bool) -> str:
    servers = "the stand-in servers are stopped: restart them first" if stopped else \
        "the stand-in servers are still running"
    return (f"Try it yourself ({servers}):\n"
            f"  . {env_file}\n"
            + ("  ddtree-deploy restart --all\n" if stopped else "")
            + "  ddtree-deploy status\n"
            + "  ddtree-deploy stop --all      # stops the stand-in servers")


def _fresh_fleet(root: Path) -> Path:
    if (root / "inventory.yaml").exists():
        _stop_servers({**os.environ, **fleet_env(root)})
    shutil.rmtree(root, ignore_errors=True)
    with console.status("building the sandbox fleet (real sglang 0.5.17 files, cu130 and cu128 torch metadata)"):
        inventory = build_fleet(root)
    console.print(Panel.fit(f"sandbox fleet built: {inventory}", title="ddtree-deploy demo"))
    return inventory


def _step(title: str, cli_args: list[str], expected: int, env: dict[str, str]) -> int:
    console.rule(f"[bold]{title}")
    command = ["ddtree-deploy", *cli_args]
    console.print(f"[dim]$ {' '.join(command)}[/]")
    started = time.monotonic()
    code = subprocess.run([sys.executable, "-m", "ddtree_deploy.cli", *cli_args], env=env, check=False).returncode
    mark = "[green]as expected[/]" if code == expected else f"[red]expected exit {expected}[/]"
    console.print(f"[dim]exit {code} ({mark}[dim]) in {time.monotonic() - started:.1f}s[/]")
    return code


def _stop_servers(env: dict[str, str]) -> None:
    subprocess.run([sys.executable, "-m", "ddtree_deploy.cli", "stop", "--all"], env=env, check=False,
                   stdout=subprocess.DEVNULL)


if __name__ == "__main__":
    sys.exit(main())
