"""Client of hostside/service.py: the server's start, stop, readiness wait, status and log, and loopback HTTP.

Each function takes the host's service block from the inventory (`spec`) and returns the helper's
answer typed. A start the helper refuses for a reason worth reporting (port taken, already running,
a command that cannot run) is a `StartReport` with its `refusal`, not an exception.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field, model_validator

if TYPE_CHECKING:
    from ddtree_deploy.inventory import ProcessService, SystemdService
    from ddtree_deploy.transport import Transport

    ServiceSpec = ProcessService | SystemdService

#: what ended a wait (or a restart before its wait)
Reason = Literal["ready", "exited", "fatal_log", "port_taken", "timeout", "not_running", "already_running",
                 "spawn_failed"]
Refusal = Literal["port_taken", "already_running", "spawn_failed"]
#: helper refusals of service_start that are outcomes to report, not errors to raise
_START_REFUSALS = ("port_taken", "already_running", "spawn_failed")


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
    refusal: Refusal | None = None
    pid: int | None = None
    argv: list[str] = Field(default_factory=list)
    log_offset: Any = Field(default=None, description="where this run's log begins; pass to wait()")
    port_owners: list[PortOwner] = Field(default_factory=list)


class _Started(BaseModel):
    pid: int | None = None
    log_offset: Any = None


class Waited(BaseModel):
    """How a readiness wait on the host ended."""

    ready: bool
    reason: Reason
    waited_s: float = 0.0
    log_tail: list[str] = Field(default_factory=list, description="last 40 log lines when it ended")
    pid: int | None = None
    argv: list[str] = Field(default_factory=list)
    port: int | None = None
    matched: FatalMatch | None = None
    port_owners: list[PortOwner] = Field(default_factory=list)
    last_http: dict[str, Any] | None = Field(default=None, description="the last readiness GET's answer")
    log_offset: Any = Field(default=None, description="where the log stood when the wait ended")


class ServiceStatus(BaseModel):
    host: str
    kind: Literal["process", "systemd"]
    running: bool
    pid: int | None = None
    pids: list[int] = Field(default_factory=list)
    argv: list[str] | None = None
    started: float | None = Field(default=None, description="when the helper started it (None: unknown, systemd)")
    port: int
    listening: bool
    port_owners: list[PortOwner] = Field(default_factory=list)
    health_status: int | None = None
    health_error: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _health(cls, data: Any) -> Any:
        """The helper nests the health GET's answer as {"health": {status, error}}."""
        if isinstance(data, dict) and isinstance(data.get("health"), dict):
            health = data["health"]
            data = {**data, "health_status": health.get("status"), "health_error": health.get("error")}
        return data

    @property
    def healthy(self) -> bool:
        return self.running and self.health_status == 200


class LogChunk(BaseModel):
    host: str
    text: str
    offset: Any = Field(description="pass back to read what follows (bytes, or a journal cursor)")


class HttpAnswer(BaseModel):
    """One request made on the host's loopback by the helper."""

    status: int | None = Field(description="HTTP status; None when no answer came (refused, timeout)")
    body: str = ""
    error: str | None = None
    elapsed_s: float = 0.0


def _dump(spec: ServiceSpec) -> dict[str, Any]:
    return spec.model_dump(mode="json")


def stop(t: Transport, spec: ServiceSpec, grace_s: float | None = None) -> StopReport:
    """Stop the server's whole process group (or unit) and report whether its port is free."""
    args: dict[str, Any] = {"spec": _dump(spec)}
    if grace_s is not None:
        args["grace_s"] = grace_s
    return t.run_helper("service_stop", args).parsed(StopReport, host=t.host.name)


def start(t: Transport, spec: ServiceSpec, argv: list[str]) -> StartReport:
    """Start `argv` without waiting; a refusal (port taken, already running, bad command) is reported."""
    result = t.run_helper("service_start", {"spec": _dump(spec), "args": argv, "env": {}})
    if result.ok:
        started = result.parsed(_Started)
        return StartReport(host=t.host.name, started=True, message=f"started pid {started.pid}", pid=started.pid,
                           argv=argv, log_offset=started.log_offset)
    error = result.error()
    if result.refusal not in _START_REFUSALS:
        raise error
    return StartReport.model_validate({"host": t.host.name, "started": False, "refusal": error.code,
                                       "message": error.message, "argv": argv,
                                       "port_owners": error.details.get("owners") or []})


def wait(t: Transport, spec: ServiceSpec, since_offset: Any = 0, timeout_s: float | None = None) -> Waited:
    """Wait on the host until ready, failing fast on exit, a fatal log line or a foreign port owner."""
    args: dict[str, Any] = {"spec": _dump(spec), "since_offset": since_offset}
    if timeout_s is not None:
        args["timeout_s"] = timeout_s
    return t.run_helper("service_wait", args).parsed(Waited)


def status(t: Transport, spec: ServiceSpec) -> ServiceStatus:
    """Is the server alive, is its port listening, what does GET /health answer."""
    return t.run_helper("service_status", {"spec": _dump(spec)}).parsed(ServiceStatus, host=t.host.name)


def logs(t: Transport, spec: ServiceSpec, n: int = 40, offset: Any = None) -> LogChunk:
    """The last `n` log lines, or (with `offset`) what the server wrote since."""
    args = {"spec": _dump(spec), "n": n, "offset": offset}
    return t.run_helper("service_logs", args).parsed(LogChunk, host=t.host.name)


def http(t: Transport, port: int, path: str, *, method: str = "GET", body: Any = None,
         timeout: float = 60.0) -> HttpAnswer:
    """One request to `port` on the host's loopback, made by the helper."""
    args = {"port": port, "path": path, "method": method, "body": body, "timeout": timeout}
    return t.run_helper("http", args).parsed(HttpAnswer)
