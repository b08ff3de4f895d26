"""The step vocabulary: what one host can be asked to do, each step a function of (HostRun, args).

Steps read facts first and act only on the difference (pyinfra's habit): `plan` finds that an
overlay is already applied and ends the run as a no-op; `restart` without a service says so.
Steps never fan out and never render; they return `StepOutcome`s that keep their evidence.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ddtree_deploy import abi, service
from ddtree_deploy.errors import DeployError
from ddtree_deploy.inventory import HostSpec
from ddtree_deploy.transport import Transport


class StepOutcome(BaseModel):
    step: str
    status: Literal["ok", "noop", "failed", "skipped"]
    message: str = ""
    code: str | None = None
    hint: str = ""
    duration_s: float = 0.0
    details: dict[str, Any] = Field(default_factory=dict)


class HostStatus(BaseModel):
    """One row of `status`."""

    host: str
    python: str
    package_root: str
    sglang: str | None
    torch: str | None
    cuda_variant: str | None
    overlay: str | None = None
    snapshot: str | None = None
    launch_args: list[str] = Field(default_factory=list)
    lock: str | None = None
    journal_open: bool = False
    server: str = "no service"
    notes: list[str] = Field(default_factory=list)
    needs_attention: bool = False


def host_status(transport: Transport) -> HostStatus:
    """Facts for one `status` row: fingerprint, deployed state, lock, journal, server health."""
    fp = abi.Fingerprint.from_helper(transport.call("fingerprint"))
    state = transport.call("state")
    deployed = state.get("deployed") or {}
    lock = state.get("lock")
    notes = []
    if state.get("journal"):
        notes.append("open journal: an operation was interrupted; run `ddtree-deploy rollback`")
    if lock:
        notes.append("lock expired" if lock.get("expired") else f"locked since {lock.get('started')}")
    overlay = f"{deployed['overlay']}@{deployed['version']}" if deployed.get("overlay") else None
    server = _server_health(transport)
    return HostStatus(
        host=transport.host.name, python=fp.python_version, package_root=str(state.get("package_root")),
        sglang=fp.sglang_version, torch=fp.torch_version, cuda_variant=fp.cuda_variant, overlay=overlay,
        snapshot=deployed.get("snapshot"), launch_args=list(deployed.get("launch_args") or []),
        lock=lock.get("owner") if lock else None, journal_open=bool(state.get("journal")), notes=notes, server=server,
        needs_attention=bool(state.get("journal")) or bool(lock and not lock.get("expired"))
        or server.startswith("unhealthy"),
    )


def _server_health(transport: Transport) -> str:
    """'healthy', 'unhealthy: <why>' or 'no service'; a server that is simply stopped is unhealthy."""
    if transport.host.service is None:
        return "no service"
    s = service.status(transport)
    if s.healthy:
        return f"healthy (pid {s.pid}, port {s.port})"
    why = "not running" if not s.running else (s.health_error or f"/health answered {s.health_status}")
    return f"unhealthy: {why}"
