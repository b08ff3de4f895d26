"""The host helper's wire contract: the round trip's result, the op names, and the host's state records.

The helper (hostside/) answers each request line with `{"ok": true, "data": ...}` or `{"ok": false,
"error": {code, message, hint, details}}`. `HelperResult` keeps that answer with its evidence, `Op`
names every op the helper has (one per entry of the hostside modules' `OPS` tables), and the models
below type the records the host keeps under its state folder (state.json, journal.json, lock,
server/launch.json), which several ops return. Each op's own answer is typed by its client in
remote/. Nothing here does I/O.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, Field, ValidationError

from ddtree_deploy.errors import HelperError

#: every op of the host helper, by the hostside module that serves it
Op = Literal[
    "fingerprint",  # facts
    "lock", "unlock", "state", "record_launch",  # locks
    "snapshot", "snapshots", "read_files", "prune",  # store
    "apply", "restore",  # transactions
    "mark_verified", "adopt",  # deployed
    "verify",  # drift
    "service_start", "service_stop", "service_wait", "service_status", "service_logs", "http",  # service
]

M = TypeVar("M", bound=BaseModel)

_MISMATCH_HINT = "controller and helper disagree; reinstall ddtree-deploy"


class HelperResult(BaseModel):
    """One helper round trip, with its evidence."""

    host: str
    op: str
    exit_code: int
    answer: dict[str, Any] | None = None
    stderr_tail: str = ""
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and bool(self.answer and self.answer.get("ok"))

    @property
    def data(self) -> dict[str, Any]:
        """The op's answer; raises `HelperError` (naming host, op and code) if the op failed."""
        if self.ok:
            assert self.answer is not None
            return dict(self.answer.get("data") or {})
        raise self.error()

    def parsed(self, model: type[M], **known: Any) -> M:
        """The op's answer read into `model`, with `known` fields the answer leaves out (the host's name).

        Raises:
            HelperError: the op failed, or answered in a shape `model` does not read.
        """
        try:
            return model.model_validate({**self.data, **known})
        except ValidationError as exc:
            problem = exc.errors()[0]
            where = ".".join(str(part) for part in problem["loc"]) or "answer"
            raise HelperError(f"helper op {self.op} answered unexpectedly: {where}: {problem['msg']}",
                              host=self.host, code="bad_answer", hint=_MISMATCH_HINT, result=self) from None

    def error(self) -> HelperError:
        if self.answer is None:
            tail = self.stderr_tail.strip().splitlines()[-1:] or ["no output"]
            return HelperError(f"helper op {self.op} failed (exit {self.exit_code}): {tail[0]}",
                               host=self.host, hint="run with the host's python by hand to see why", result=self)
        err = self.answer.get("error") or {}
        return HelperError(str(err.get("message", "unknown error")), host=self.host,
                           code=str(err.get("code", "helper_failed")), hint=str(err.get("hint", "")),
                           result=self, details=dict(err.get("details") or {}))

    @property
    def refusal(self) -> str | None:
        """The code of the helper's refusal (None when the op succeeded or never answered)."""
        if self.ok or self.answer is None:
            return None
        return str((self.answer.get("error") or {}).get("code", "helper_failed"))


class DeployedState(BaseModel):
    """state.json: what the host says is deployed."""

    overlay: str | None = None
    version: str | None = None
    digest: str | None = None
    base: str | None = Field(default=None, description="the sglang release the overlay was applied to")
    snapshot: str | None = Field(default=None, description="rollback target: the snapshot taken before the push")
    base_snapshot: str | None = Field(default=None, description="the package without any overlay")
    files: dict[str, Any] = Field(default_factory=dict, description="the overlay's post-images by path")
    applied: float | None = Field(default=None, description="when the apply finished")
    verified: bool = Field(default=True, description="False from the apply until the push's probes pass (records "
                                                      "older than this field count as verified)")

    @property
    def label(self) -> str | None:
        return f"{self.overlay}@{self.version}" if self.overlay else None

    @property
    def unverified(self) -> bool:
        """An overlay is applied but no probe run ever passed on it (the push that applied it did not finish)."""
        return bool(self.overlay) and not self.verified


class DamagedRecord(BaseModel):
    """A state file the helper could not read (state.json, journal.json): named, never guessed at."""

    file: str = Field(description="state.json or journal.json")
    path: str = Field(description="where it is on the host")
    error: str = Field(description="why it cannot be read")


class LockController(BaseModel):
    """The controller process that took a lock (to take over a lock whose controller died)."""

    host: str = ""
    pid: int = 0


class LockRecord(BaseModel):
    """The host lock: who holds it, since when, until when."""

    owner: str | None = Field(default=None, description="None when the lock file was unreadable")
    started: float | None = None
    expires: float = 0.0
    controller: LockController | None = None
    expired: bool = Field(default=False, description="set by `state`: the expiry has passed")
    unreadable: bool = Field(default=False, description="the lock file was not JSON (counts as expired)")


class Journal(BaseModel):
    """journal.json: an apply or restore that has not finished (present only while one is open)."""

    op: str
    snapshot: str | None = Field(default=None, description="what a rollback restores")
    started: float | None = None
    by: str = ""
    overlay: str | None = None
    paths: list[str] = Field(default_factory=list)
    created: list[str] = Field(default_factory=list)
    dirs_created: list[str] = Field(default_factory=list)
    interrupted: Journal | None = Field(default=None, description="restore: the journal it was closing")
    damaged: DamagedRecord | None = Field(default=None, description="restore: the unreadable journal.json it was "
                                                                    "closing, its bytes kept at `path` until a "
                                                                    "restore finishes")

    def damage(self) -> DamagedRecord | None:
        """The damaged journal this chain of interrupted restores was closing (its bytes' copy), if any."""
        journal: Journal | None = self
        while journal is not None and journal.damaged is None:
            journal = journal.interrupted
        return journal.damaged if journal is not None else None


class LaunchRecord(BaseModel):
    """server/launch.json: how the server was last started."""

    argv: list[str] = Field(default_factory=list)
    server_args: list[str] = Field(default_factory=list, description="the overlay's part of argv")
    time: float | None = None
    by: str = ""


class HostState(BaseModel):
    """The `state` op's answer: what is deployed, the lock, an open journal, recent history, the last launch."""

    state_dir: str
    package_root: str
    deployed: DeployedState | None = None
    lock: LockRecord | None = None
    journal: Journal | None = None
    history: list[dict[str, Any]] = Field(default_factory=list, description="the newest history.jsonl events")
    launch: LaunchRecord | None = None
    damaged: list[DamagedRecord] = Field(default_factory=list, description="state files that are not readable JSON "
                                                                           "(read as absent above)")
