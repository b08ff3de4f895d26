"""Playing a built-in playbook from a command: select the hosts, start connecting, then import the steps."""

from __future__ import annotations

from typing import Any

from ddtree_deploy import output as out
from ddtree_deploy.commands._selection import Selection
from ddtree_deploy.fleet import ALL_AT_ONCE, DEFAULT_FORKS, Amount, connecting


def play_builtin(
    name: str,
    selection: Selection,
    *,
    as_json: bool,
    default_all: bool = False,
    wave_size: Amount = ALL_AT_ONCE,
    max_failures: Amount | None = None,
    forks: int = DEFAULT_FORKS,
    overlay: str | None = None,
    **run_options: Any,
) -> None:
    """Play `playbooks/<name>.yaml` on the selected hosts with these `RunOptions`, render it, exit with its code.

    `overlay` (NAME[@VERSION], looked up in `run_options["overlays_dir"]`) is the one a push deploys.
    """
    with out.errors_rendered(as_json):
        inv, hosts = selection.load(default_all=default_all)
        fleet_options = selection.fleet_options(wave_size=wave_size, max_failures=max_failures, forks=forks)
        with connecting(inv, hosts, name, fleet_options) as started:
            # Imported once the hosts are connecting: the steps and their models take longer to import
            # than a connection and a helper take to start, so the two overlap.
            from ddtree_deploy import playbook
            from ddtree_deploy.catalog import load_overlay, overlays_path
            from ddtree_deploy.commands._play import exit_code, render, run_playbook
            from ddtree_deploy.hostrun import RunOptions

            the_overlay = load_overlay(overlay, overlays_path(run_options.get("overlays_dir"))) if overlay else None
            if the_overlay is not None:
                run_options["overlay"] = the_overlay.label
            report = run_playbook(inv, hosts, playbook.builtin(name), RunOptions(**run_options), the_overlay,
                                  fleet_options, as_json=as_json, started=started)
    out.emit(report, as_json=as_json, human=render, code=exit_code(report))
