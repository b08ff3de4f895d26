"""Client of hostside/locks.py: the host lock, the host's state in one round trip, the last launch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel

from ddtree_deploy.errors import HelperError
from ddtree_deploy.protocol import HostState, LaunchRecord, LockController, LockRecord

if TYPE_CHECKING:
    from ddtree_deploy.transport import Transport


class LockTaken(BaseModel):
    lock: LockRecord
    replaced: LockRecord | None = None


class _Released(BaseModel):
    released: LockRecord | None = None


def lock(t: Transport, *, ttl_s: float, controller: LockController, take_over: str | None = None) -> LockTaken:
    """Lock the host for `t.owner` until `ttl_s` from now (`take_over`: the owner of a lock known to be dead).

    Raises:
        HelperError: code locked, with the holder's record (see `holder_of`).
    """
    args = {"owner": t.owner, "ttl_s": ttl_s, "controller": controller.model_dump()}
    if take_over is not None:
        args["take_over"] = take_over
    return t.run_helper("lock", args).parsed(LockTaken)


def holder_of(exc: HelperError) -> LockRecord | None:
    """The lock record a `locked` refusal names (None for any other error)."""
    holder = exc.details.get("holder") if exc.code == "locked" else None
    return LockRecord.model_validate(holder) if isinstance(holder, dict) else None


def unlock(t: Transport, *, force: bool = False) -> LockRecord | None:
    """Release the lock if `t.owner` holds it (any owner's with `force`); the released record, None if unlocked."""
    return t.run_helper("unlock", {"owner": t.owner, "force": force}).parsed(_Released).released


def state(t: Transport, *, history: int = 5) -> HostState:
    """What is deployed, the lock, an open journal, the newest `history` events and the last launch."""
    return t.run_helper("state", {"history": history}).parsed(HostState)


def record_launch(t: Transport, argv: list[str], server_args: list[str]) -> LaunchRecord:
    """Remember how the server was started (for `status` and the next restart)."""
    return t.run_helper("record_launch", {"argv": argv, "server_args": server_args}).parsed(LaunchRecord)
