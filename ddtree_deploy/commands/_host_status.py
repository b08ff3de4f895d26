"""One row of `status`: what a host is running and whether it needs attention, read in four round trips.

The status command's own work (`commands/status.py` imports it while the hosts connect): the
fingerprint, the host's state (deployed overlay, lock, journal, last launch), the deployed
overlay's own files against what it wrote, and the server's health. An overlay no probe verified
and a state file that cannot be read are notes that say what to do, never a healthy row.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from ddtree_deploy import service
from ddtree_deploy.abi import Fingerprint
from ddtree_deploy.protocol import HostState
from ddtree_deploy.remote import drift, facts, locks
from ddtree_deploy.transport import Transport
from ddtree_deploy.wording import moment, plural


class HostStatus(BaseModel):
    """One row of `status`."""

    host: str
    python: str
    package_root: str
    sglang: str | None
    torch: str | None
    cuda_variant: str | None
    overlay: str | None = None
    verified: bool | None = Field(default=None, description="the overlay's probes passed since it was applied "
                                                            "(None: nothing deployed)")
    snapshot: str | None = None
    launch_args: list[str] = Field(default_factory=list)
    lock: str | None = None
    journal_open: bool = False
    damaged: list[str] = Field(default_factory=list, description="state files on the host that cannot be read")
    server: str = "no service"
    notes: list[str] = Field(default_factory=list)
    needs_attention: bool = False
    ssh_resolver: str | None = Field(default=None, description="what read the host's ssh_config: openssh or paramiko")


def host_status(transport: Transport) -> HostStatus:
    """Facts for one `status` row: fingerprint, deployed state, lock, journal, server health."""
    fp = Fingerprint.from_helper(facts.fingerprint(transport))
    state = locks.state(transport)
    deployed, lock = state.deployed, state.lock
    overlay = deployed.label if deployed else None
    notes = _state_notes(state, transport.host.name)
    drifted = _overlay_drift_note(transport, overlay) if overlay and not (state.journal or state.damaged) else None
    if drifted:
        notes.append(drifted)
    server = _server_health(transport)
    return HostStatus(
        host=transport.host.name, python=fp.python_version, package_root=state.package_root,
        sglang=fp.sglang_version, torch=fp.torch_version, cuda_variant=fp.cuda_variant, overlay=overlay,
        verified=deployed.verified if overlay and deployed else None,
        snapshot=deployed.snapshot if deployed else None, launch_args=state.launch.argv if state.launch else [],
        lock=lock.owner if lock else None, journal_open=state.journal is not None,
        damaged=[d.path for d in state.damaged], notes=notes, server=server,
        needs_attention=state.journal is not None or bool(lock and not lock.expired) or bool(state.damaged)
        or bool(deployed and deployed.unverified) or server.startswith("unhealthy") or bool(drifted),
        ssh_resolver=transport.ssh_resolver,
    )


def _state_notes(state: HostState, host: str) -> list[str]:
    notes = [f"{d.path} is damaged ({d.error}): `ddtree-deploy rollback --host {host} --to SNAPSHOT` restores a "
             f"snapshot and rewrites it (`ddtree-deploy snapshots --host {host}` lists them)" for d in state.damaged]
    if state.journal:
        notes.append(f"open journal: an operation was interrupted; run `ddtree-deploy rollback --host {host}`")
        kept = state.journal.damage()
        if kept is not None:
            notes.append(f"the interrupted restore was closing a damaged journal.json ({kept.error}); its bytes are "
                         f"kept at {kept.path} until a rollback finishes")
    if state.deployed and state.deployed.unverified:
        notes.append(f"{state.deployed.label} was applied but never verified (the push that applied it did not "
                     f"finish its probes): push it again to restart and probe it, or `ddtree-deploy rollback "
                     f"--host {host}`")
    if state.lock:
        notes.append("lock expired" if state.lock.expired else f"locked since {moment(state.lock.started or 0)}")
    return notes


def _overlay_drift_note(transport: Transport, overlay: str) -> str | None:
    """A note when the deployed overlay's own files are no longer what it wrote (say pip reinstalled sglang)."""
    found = drift.verify(transport, overlay_only=True)
    if found.clean:
        return None
    first = found.files[0]
    return (f"{len(found.files)} of {overlay}'s {plural(found.checked, 'file')} changed since the push "
            f"({first.path} {first.kind}); `ddtree-deploy diff --host {transport.host.name}` lists them")


def _server_health(transport: Transport) -> str:
    """'healthy', 'unhealthy: <why>' or 'no service'; a server that is simply stopped is unhealthy."""
    if transport.host.service is None:
        return "no service"
    s = service.status(transport)
    if s.healthy:
        return f"healthy (pid {s.pid}, port {s.port})"
    why = "not running" if not s.running else (s.health_error or f"/health answered {s.health_status}")
    return f"unhealthy: {why}"
