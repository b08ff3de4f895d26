"""`ddtree-deploy unlock`: release a host lock left by a dead operation."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from pydantic import BaseModel

from ddtree_deploy.fleet import FleetOptions, FleetReport, fan_out
from ddtree_deploy.inventory import load_inventory, select_hosts
from ddtree_deploy.output import (
    AcceptNewHostKeyOption,
    ExitCode,
    HostOption,
    InventoryOption,
    JsonOption,
    console,
    emit,
    errors_rendered,
)
from ddtree_deploy.transport import Transport


class Unlocked(BaseModel):
    host: str
    released: dict[str, Any] | None


def unlock(
    host: HostOption = None,
    force: Annotated[bool, typer.Option("--force", help="Release a lock held by someone else.")] = False,
    inventory: InventoryOption = None,
    accept_new_host_key: AcceptNewHostKeyOption = False,
    as_json: JsonOption = False,
) -> None:
    """Release the lock of the named hosts (only your own, unless --force; forced releases go to the host's history)."""
    with errors_rendered(as_json):
        inv = load_inventory(inventory)
        hosts = select_hosts(inv, names=host)

        def work(t: Transport) -> Unlocked:
            return Unlocked(host=t.host.name, released=t.call("unlock", {"owner": t.owner, "force": force})["released"])

        report = fan_out(inv, hosts, "unlock", work, FleetOptions(accept_new_host_key=accept_new_host_key))
    emit(report, as_json=as_json, human=_render, code=ExitCode.FAILED if report.failed else ExitCode.OK)


def _render(report: FleetReport[Unlocked]) -> None:
    for row in report.hosts:
        if row.result is None:
            console.print(f"{row.host}: [red]{row.error.message if row.error else 'skipped'}[/]")
        elif row.result.released:
            console.print(f"{row.host}: released the lock of {row.result.released.get('owner')}")
        else:
            console.print(f"{row.host}: was not locked")
