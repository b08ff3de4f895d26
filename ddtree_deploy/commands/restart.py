"""`ddtree-deploy restart` and `stop`: the server alone, through the built-in playbooks of the same names."""

from __future__ import annotations

from collections.abc import Callable

from ddtree_deploy import output as out
from ddtree_deploy.commands._builtin import play_builtin
from ddtree_deploy.commands._selection import Selection, fleet_command


def _builtin_playbook_command(name: str, doc: str) -> Callable[..., None]:
    """A command that plays the built-in playbook `name` on the selected hosts, with no options of its own."""

    def command(selection: Selection, as_json: out.JsonOption = False) -> None:
        play_builtin(name, selection, as_json=as_json)

    command.__doc__ = doc
    command.__name__ = name
    return fleet_command()(command)


restart = _builtin_playbook_command(
    "restart", "Stop and start the selected hosts' servers (failing fast), then run the inventory's probes.")
stop = _builtin_playbook_command(
    "stop", "Stop the selected hosts' servers: SIGTERM to the whole process group, SIGKILL after the grace period.")
