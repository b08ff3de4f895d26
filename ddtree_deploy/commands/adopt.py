"""`ddtree-deploy adopt`: accept a host's installed files as the baseline drift is measured against."""

from __future__ import annotations

from ddtree_deploy import output as out
from ddtree_deploy.commands._builtin import play_builtin
from ddtree_deploy.commands._selection import Selection, fleet_command
from ddtree_deploy.errors import UsageError


@fleet_command(only=("host", "inventory", "accept_new_host_key"))
def adopt(
    selection: Selection,
    as_json: out.JsonOption = False,
) -> None:
    """Make the named hosts' installed files the new baseline, once `diff --content` showed them.

    A snapshot (reason adopt) of the package the deployed overlay sits on becomes the rollback
    target and the base, so later pushes need no --force and `rollback` restores the adopted files
    without the overlay. No package file changes; the server is not touched. A host with an open
    journal or another's lock is refused. Exit codes as for push.
    """
    if not selection.hosts:
        with out.errors_rendered(as_json):
            raise UsageError("adopt needs --host NAME", hint="name each host whose files `ddtree-deploy diff "
                                                            "--content --host NAME` showed you")
    play_builtin("adopt", selection, as_json=as_json)
