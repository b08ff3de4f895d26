"""Fan-out over hosts: every selected host runs the same work in parallel, in waves.

One `Transport` per host per command; a wave lets every host finish (like Fabric's groups), then
the report says, host by host, what came back or which error stopped it. `max_failures` stops
later waves once too many hosts failed (a canary is `--wave-size 1 --max-failures 0`). `connecting`
starts the first wave's connections early, so that they overlap what a command still loads. Nothing
here knows what a step does.
"""

from __future__ import annotations

import getpass
import os
import socket
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Generic, TypeVar

from pydantic import BaseModel, Field

from ddtree_deploy.errors import DeployError
from ddtree_deploy.inventory import HostSpec, Inventory
from ddtree_deploy.transport import Transport, transport_for

R = TypeVar("R", bound=BaseModel)


class ErrorInfo(BaseModel):
    """A `DeployError`, as data."""

    code: str
    message: str
    hint: str = ""
    details: dict[str, object] = Field(default_factory=dict)

    @classmethod
    def of(cls, exc: DeployError) -> ErrorInfo:
        return cls(code=exc.code, message=str(exc), hint=exc.hint, details=exc.details)


class HostRow(BaseModel, Generic[R]):
    host: str
    result: R | None = None
    error: ErrorInfo | None = None
    skipped: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None and not self.skipped


class FleetReport(BaseModel, Generic[R]):
    command: str
    hosts: list[HostRow[R]]

    @property
    def succeeded(self) -> list[HostRow[R]]:
        return [row for row in self.hosts if row.ok]

    @property
    def failed(self) -> list[HostRow[R]]:
        return [row for row in self.hosts if not row.ok]


class FleetOptions(BaseModel):
    accept_new_host_key: bool = False
    wave_size: int = Field(default=0, ge=0, description="hosts per wave; 0 = all at once")
    max_failures: int | None = Field(default=None, ge=0, description="stop starting waves past this many failures")


def operator(command: str) -> str:
    """Who is acting, recorded in locks and histories."""
    return f"{getpass.getuser()}@{socket.gethostname()} pid {os.getpid()} ({command})"


@contextmanager
def connecting(
    inventory: Inventory, hosts: list[HostSpec], command: str, options: FleetOptions | None = None
) -> Iterator[dict[str, Transport]]:
    """Transports for the first wave of `hosts`, already connecting and starting their helpers in the background.

    Pass them to `fan_out(started=...)`, which takes over those it uses; any left when the block
    ends (the command failed before fanning out) are closed. Connecting takes no lock and changes
    nothing on a host; its errors are raised by each host's first op, as without this.
    """
    options = options or FleetOptions()
    owner = operator(command)
    wave = hosts[:options.wave_size or len(hosts)]
    started = {h.name: transport_for(h, inventory.ssh, owner, options.accept_new_host_key) for h in wave}
    for transport in started.values():
        transport.start()
    try:
        yield started
    finally:
        for transport in started.values():
            transport.close()


def fan_out(
    inventory: Inventory,
    hosts: list[HostSpec],
    command: str,
    work: Callable[[Transport], R],
    options: FleetOptions | None = None,
    started: dict[str, Transport] | None = None,
) -> FleetReport[R]:
    """Run `work` on every host, in waves, each host on its own transport; collect rows in host order.

    A host with a transport in `started` (see `connecting`) uses it, and takes it out of `started`.
    """
    options = options or FleetOptions()
    owner = operator(command)
    started = started if started is not None else {}

    def transport(host: HostSpec) -> Transport:
        return started.pop(host.name, None) or transport_for(host, inventory.ssh, owner, options.accept_new_host_key)

    size = options.wave_size or max(len(hosts), 1)
    rows: dict[str, HostRow[R]] = {}
    for start in range(0, len(hosts), size):
        wave = hosts[start:start + size]
        if options.max_failures is not None and _failures(rows) > options.max_failures:
            rows.update({h.name: HostRow[R](host=h.name, skipped=True) for h in wave})
            continue
        with ThreadPoolExecutor(max_workers=len(wave)) as pool:
            futures = {h.name: pool.submit(_run_one, transport(h), work) for h in wave}
            rows.update({name: future.result() for name, future in futures.items()})
    return FleetReport[R](command=command, hosts=[rows[h.name] for h in hosts])


def _run_one(transport: Transport, work: Callable[[Transport], R]) -> HostRow[R]:
    host = transport.host
    try:
        return HostRow[R](host=host.name, result=work(transport))
    except DeployError as exc:
        exc.host = exc.host or host.name
        return HostRow[R](host=host.name, error=ErrorInfo.of(exc))
    except Exception as exc:  # a bug on one host must not hide the other hosts' results
        details: dict[str, object] = {"traceback": traceback.format_exc()}
        return HostRow[R](host=host.name, error=ErrorInfo(code="internal_error", message=f"{type(exc).__name__}: {exc}",
                                                          hint="a ddtree-deploy bug; the traceback is in --json details",
                                                          details=details))
    finally:
        transport.close()


def _failures(rows: dict[str, HostRow[R]]) -> int:
    return sum(1 for row in rows.values() if row.error is not None)
