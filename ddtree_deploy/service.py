"""Stopping, starting and waiting for a host's SGLang server, through the host helper's service ops.

Every function takes the host's `Transport` and uses the inventory's service block of that host
(`transport.host.service`). Results are pydantic reports that keep the evidence (reason, log tail,
pid, argv); a server that fails to come up is a report with `ready=False`, not an exception, so
the caller decides what happens next. This module never decides to roll back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field

from ddtree_deploy.errors import ServiceError

if TYPE_CHECKING:
    from ddtree_deploy.inventory import ProcessService, SystemdService
    from ddtree_deploy.transport import Transport

#: what ended a wait (or a restart before its wait)
Reason = Literal["ready", "exited", "fatal_log", "port_taken", "timeout", "not_running", "already_running",
                 "spawn_failed"]
#: helper refusals of service_start that are outcomes to report, not errors to raise
_START_REFUSALS = ("port_taken", "already_running", "spawn_failed")

_HINTS: dict[str, str] = {
    "exited": "the server died while starting; read the log tail (ddtree-deploy logs --host HOST)",
    "fatal_log": "the server's log shows a fatal error; read the log tail",
    "port_taken": "another process holds the server's port; stop it or change the service port",
    "timeout": "the server is alive but never answered ready; raise ready_timeout_s or read the log",
    "not_running": "no server was started; run ddtree-deploy restart --host HOST",
    "already_running": "a server already runs; restart stops it first",
    "spawn_failed": "the service command cannot be executed; fix it in the inventory",
}


class PortOwner(BaseModel):
    pid: int | None = Field(description="None when /proc hides the owner from the helper's user")
    pgid: int | None = None
    command: str = "?"


class FatalMatch(BaseModel):
    pattern: str
    line: str


class StopReport(BaseModel):
    host: str
    was_running: bool
    pids: list[int] = Field(default_factory=list, description="members of the group when the stop began")
    sigkill: bool = Field(default=False, description="the grace period ran out and the group was SIGKILLed")
    waited_s: float = 0.0
    port: int
    port_free: bool
    port_owners: list[PortOwner] = Field(default_factory=list)


class StartReport(BaseModel):
    host: str
    started: bool
    message: str
    refusal: Literal["port_taken", "already_running", "spawn_failed"] | None = None
    pid: int | None = None
    argv: list[str] = Field(default_factory=list)
    log_offset: Any = Field(default=None, description="where this run's log begins; pass to wait()")
    port_owners: list[PortOwner] = Field(default_factory=list)


class ServiceReport(BaseModel):
    """How a start (or restart) ended: ready, or why not, with the evidence."""

    host: str
    ready: bool
    reason: Reason
    message: str
    waited_s: float = 0.0
    log_tail: list[str] = Field(default_factory=list, description="last 40 log lines when it ended")
    pid: int | None = None
    argv: list[str] = Field(default_factory=list)
    matched: FatalMatch | None = None
    port_owners: list[PortOwner] = Field(default_factory=list)
    last_http: dict[str, Any] | None = Field(default=None, description="the last readiness GET's answer")
    log_offset: Any = Field(default=None, description="where the log stood when the wait ended")
    stop: StopReport | None = None

    def raise_for_failure(self) -> None:
        """Raise `ServiceError` (code `server_<reason>`) unless the server is ready."""
        if self.ready:
            return
        raise ServiceError(self.message, host=self.host, code=f"server_{self.reason}",
                           hint=_HINTS.get(self.reason, ""), details={"log_tail": self.log_tail})


class ServiceStatus(BaseModel):
    host: str
    kind: Literal["process", "systemd"]
    running: bool
    pid: int | None = None
    pids: list[int] = Field(default_factory=list)
    argv: list[str] | None = None
    port: int
    listening: bool
    port_owners: list[PortOwner] = Field(default_factory=list)
    health_status: int | None = None
    health_error: str | None = None

    @property
    def healthy(self) -> bool:
        return self.running and self.health_status == 200


class LogChunk(BaseModel):
    host: str
    text: str
    offset: Any = Field(description="pass back to read what follows (bytes, or a journal cursor)")


def launch_argv(spec: ProcessService | SystemdService, server_args: Sequence[str] = ()) -> list[str]:
    """The server's argv: the service command, the inventory's base args, then the overlay's server.args."""
    command = spec.command if spec.kind == "process" else []
    return [*command, *spec.args, *server_args]


def stop(transport: Transport, grace_s: float | None = None) -> StopReport:
    """Stop the server's whole process group (or unit) and report whether its port is free."""
    spec = _spec(transport)
    args: dict[str, Any] = {"spec": _dump(spec)}
    if grace_s is not None:
        args["grace_s"] = grace_s
    return StopReport(host=transport.host.name, **transport.call("service_stop", args))


def start(transport: Transport, server_args: Sequence[str] = ()) -> StartReport:
    """Start the server without waiting; a refusal (port taken, already running, bad command) is reported."""
    spec = _spec(transport)
    argv = launch_argv(spec, server_args)
    result = transport.run_helper("service_start", {"spec": _dump(spec), "args": argv, "env": {}})
    if result.ok:
        data = result.data
        return StartReport(host=transport.host.name, started=True, message=f"started pid {data.get('pid')}",
                           pid=data.get("pid"), argv=argv, log_offset=data.get("log_offset"))
    error = (result.answer or {}).get("error") or {}
    if error.get("code") not in _START_REFUSALS:
        raise result.error()
    return StartReport(host=transport.host.name, started=False, refusal=error["code"], message=error["message"],
                       argv=argv, port_owners=(error.get("details") or {}).get("owners") or [])


def wait(transport: Transport, since_offset: Any = 0, timeout_s: float | None = None) -> ServiceReport:
    """Wait on the host until ready, failing fast on exit, a fatal log line or a foreign port owner."""
    spec = _spec(transport)
    args: dict[str, Any] = {"spec": _dump(spec), "since_offset": since_offset}
    if timeout_s is not None:
        args["timeout_s"] = timeout_s
    data = transport.call("service_wait", args)
    return ServiceReport(host=transport.host.name, message=_message(data), **_pick(data, ServiceReport))


def restart(transport: Transport, server_args: Sequence[str] = ()) -> ServiceReport:
    """Stop, start with `server_args` after the base args, and wait for readiness."""
    stopped = stop(transport)
    if not stopped.port_free:
        return ServiceReport(host=transport.host.name, ready=False, reason="port_taken", stop=stopped,
                             port_owners=stopped.port_owners,
                             message=f"port {stopped.port} is still in use by {_owners(stopped.port_owners)}")
    started = start(transport, server_args)
    if started.refusal is not None:
        return ServiceReport(host=transport.host.name, ready=False, reason=started.refusal, message=started.message,
                             argv=started.argv, port_owners=started.port_owners, stop=stopped)
    waited = wait(transport, since_offset=started.log_offset)
    return waited.model_copy(update={"stop": stopped, "argv": started.argv, "pid": waited.pid or started.pid})


def status(transport: Transport) -> ServiceStatus:
    """Is the server alive, is its port listening, what does GET /health answer."""
    data = transport.call("service_status", {"spec": _dump(_spec(transport))})
    health = data.get("health") or {}
    return ServiceStatus(host=transport.host.name, health_status=health.get("status"),
                         health_error=health.get("error"), **_pick(data, ServiceStatus))


def logs(transport: Transport, n: int = 40, offset: Any = None) -> LogChunk:
    """The last `n` log lines, or (with `offset`) what the server wrote since; for `logs --follow`."""
    data = transport.call("service_logs", {"spec": _dump(_spec(transport)), "n": n, "offset": offset})
    return LogChunk(host=transport.host.name, text=data["text"], offset=data["offset"])


def _spec(transport: Transport) -> ProcessService | SystemdService:
    spec = transport.host.service
    if spec is None:
        raise ServiceError(f"{transport.host.name} has no service block", host=transport.host.name,
                           code="no_service", hint="add a `service:` block to the host in the inventory")
    return spec


def _dump(spec: ProcessService | SystemdService) -> dict[str, Any]:
    return spec.model_dump(mode="json")


def _pick(data: dict[str, Any], model: type[BaseModel]) -> dict[str, Any]:
    """The helper's answer restricted to the model's fields (the helper may say more)."""
    return {k: v for k, v in data.items() if k in model.model_fields and k != "host"}


def _owners(owners: Sequence[PortOwner | dict[str, Any]]) -> str:
    parsed = [PortOwner.model_validate(o) if isinstance(o, dict) else o for o in owners]
    return ", ".join(f"pid {o.pid} ({o.command})" if o.pid else "a process hidden from this user"
                     for o in parsed) or "an unknown process"


def _message(data: dict[str, Any]) -> str:
    """One sentence on how a wait ended."""
    reason, waited = data["reason"], data.get("waited_s", 0.0)
    matched = data.get("matched") or {}
    if reason == "ready":
        return f"ready after {waited:.1f}s"
    if reason == "exited":
        why = f"; log: {matched['line'].strip()}" if matched else ""
        return f"server exited after {waited:.1f}s of waiting{why}"
    if reason == "fatal_log":
        return f"fatal line in the log after {waited:.1f}s: {matched.get('line', '').strip()}"
    if reason == "port_taken":
        return f"port {data.get('port')} is served by another process: {_owners(data.get('port_owners') or [])}"
    if reason == "timeout":
        last = data.get("last_http") or {}
        got = last.get("status") or last.get("error") or "no answer"
        return f"not ready after {waited:.0f}s (last readiness answer: {got})"
    return "no server is running"
