"""`ddtree-deploy unlock`: release a host lock left by a dead operation."""

from __future__ import annotations

from typing import Annotated

import typer
from pydantic import BaseModel

from ddtree_deploy import output as out
from ddtree_deploy.commands._selection import Selection, fleet_command
from ddtree_deploy.fleet import FleetReport, fan_out
from ddtree_deploy.protocol import LockRecord
from ddtree_deploy.remote import locks
from ddtree_deploy.transport import Transport


class Unlocked(BaseModel):
    host: str
    released: LockRecord | None


@fleet_command(only=("host", "inventory", "accept_new_host_key"))
def unlock(
    selection: Selection,
    force: Annotated[bool, typer.Option("--force", help="Release a lock held by someone else.")] = False,
    as_json: out.JsonOption = False,
) -> None:
    """Release the lock of the named hosts (only your own, unless --force; forced releases go to the host's history)."""
    with out.errors_rendered(as_json):
        inv, hosts = selection.load()

        def work(t: Transport) -> Unlocked:
            return Unlocked(host=t.host.name, released=locks.unlock(t, force=force))

        report = fan_out(inv, hosts, "unlock", work, selection.fleet_options())
    out.emit(report, as_json=as_json, human=_render, code=out.ExitCode.FAILED if report.failed else out.ExitCode.OK)


def _render(report: FleetReport[Unlocked]) -> None:
    for row in report.hosts:
        if row.result is None:
            out.print_host_error(row.host, row.error)
        elif row.result.released:
            out.console.print(f"{row.host}: released the lock of {row.result.released.owner}")
        else:
            out.console.print(f"{row.host}: was not locked")
