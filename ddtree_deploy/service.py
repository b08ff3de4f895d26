"""Stopping, starting and waiting for a host's SGLang server, through the host helper's service ops.

Every function takes the host's `Transport` and uses the inventory's service block of that host
(`transport.host.service`); the round trips are `remote/service.py`'s. Results are pydantic
reports that keep the evidence (reason, log tail, pid, argv); a server that fails to come up is a
report with `ready=False`, not an exception, so the caller decides what happens next. This module
owns the launch argv, the restart sequence and how a failed start is told; it never decides to
roll back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ddtree_deploy.errors import ServiceError
from ddtree_deploy.remote import service as remote
from ddtree_deploy.remote.service import LogChunk, PortOwner, ServiceStatus, StartReport, StopReport, Waited

if TYPE_CHECKING:
    from ddtree_deploy.inventory import ProcessService, SystemdService
    from ddtree_deploy.transport import Transport

_HINTS: dict[str, str] = {
    "exited": "the server died while starting; read the log tail (ddtree-deploy logs --host HOST)",
    "fatal_log": "the server's log shows a fatal error; read the log tail",
    "port_taken": "another process holds the server's port; stop it or change the service port",
    "timeout": "the server is alive but never answered ready; raise ready_timeout_s or read the log",
    "not_running": "no server was started; run ddtree-deploy restart --host HOST",
    "already_running": "a server already runs; restart stops it first",
    "spawn_failed": "the service command cannot be executed; fix it in the inventory",
}


class ServiceReport(Waited):
    """How a start (or restart) ended: ready, or why not, with the evidence and a sentence saying it."""

    host: str
    message: str
    stop: StopReport | None = None

    def raise_for_failure(self) -> None:
        """Raise `ServiceError` (code `server_<reason>`) unless the server is ready."""
        if self.ready:
            return
        raise ServiceError(self.message, host=self.host, code=f"server_{self.reason}",
                           hint=_HINTS.get(self.reason, ""), details={"log_tail": self.log_tail})


def launch_argv(spec: ProcessService | SystemdService, server_args: Sequence[str] = ()) -> list[str]:
    """The server's argv: the service command, the inventory's base args, then the overlay's server.args."""
    command = spec.command if spec.kind == "process" else []
    return [*command, *spec.args, *server_args]


def stop(transport: Transport, grace_s: float | None = None) -> StopReport:
    """Stop the server's whole process group (or unit) and report whether its port is free."""
    return remote.stop(transport, _spec(transport), grace_s)


def start(transport: Transport, server_args: Sequence[str] = ()) -> StartReport:
    """Start the server without waiting; a refusal (port taken, already running, bad command) is reported."""
    spec = _spec(transport)
    return remote.start(transport, spec, launch_argv(spec, server_args))


def wait(transport: Transport, since_offset: Any = 0, timeout_s: float | None = None) -> ServiceReport:
    """Wait on the host until ready, failing fast on exit, a fatal log line or a foreign port owner."""
    waited = remote.wait(transport, _spec(transport), since_offset, timeout_s)
    return ServiceReport(host=transport.host.name, message=_message(waited), **waited.model_dump())


def restart(transport: Transport, server_args: Sequence[str] = ()) -> ServiceReport:
    """Stop, start with `server_args` after the base args, and wait for readiness."""
    stopped = stop(transport)
    if not stopped.port_free:
        return ServiceReport(host=transport.host.name, ready=False, reason="port_taken", stop=stopped,
                             port=stopped.port, port_owners=stopped.port_owners,
                             message=f"port {stopped.port} is still in use by {_owners(stopped.port_owners)}")
    started = start(transport, server_args)
    if started.refusal is not None:
        return ServiceReport(host=transport.host.name, ready=False, reason=started.refusal, message=started.message,
                             argv=started.argv, port_owners=started.port_owners, stop=stopped)
    waited = wait(transport, since_offset=started.log_offset)
    return waited.model_copy(update={"stop": stopped, "argv": started.argv, "pid": waited.pid or started.pid})


def status(transport: Transport) -> ServiceStatus:
    """Is the server alive, is its port listening, what does GET /health answer."""
    return remote.status(transport, _spec(transport))


def logs(transport: Transport, n: int = 40, offset: Any = None) -> LogChunk:
    """The last `n` log lines, or (with `offset`) what the server wrote since; for `logs --follow`."""
    return remote.logs(transport, _spec(transport), n, offset)


def _spec(transport: Transport) -> ProcessService | SystemdService:
    spec = transport.host.service
    if spec is None:
        raise ServiceError(f"{transport.host.name} has no service block", host=transport.host.name,
                           code="no_service", hint="add a `service:` block to the host in the inventory")
    return spec


def _owners(owners: Sequence[PortOwner]) -> str:
    return ", ".join(f"pid {o.pid} ({o.command})" if o.pid else "a process hidden from this user"
                     for o in owners) or "an unknown process"


def _message(waited: Waited) -> str:
    """One sentence on how a wait ended."""
    reason, seconds, matched = waited.reason, waited.waited_s, waited.matched
    if reason == "ready":
        return f"ready after {seconds:.1f}s"
    if reason == "exited":
        why = f"; log: {matched.line.strip()}" if matched else ""
        return f"server exited after {seconds:.1f}s of waiting{why}"
    if reason == "fatal_log":
        return f"fatal line in the log after {seconds:.1f}s: {matched.line.strip() if matched else ''}"
    if reason == "port_taken":
        return f"port {waited.port} is served by another process: {_owners(waited.port_owners)}"
    if reason == "timeout":
        last = waited.last_http or {}
        got = last.get("status") or last.get("error") or "no answer"
        return f"not ready after {seconds:.0f}s (last readiness answer: {got})"
    return "no server is running"
