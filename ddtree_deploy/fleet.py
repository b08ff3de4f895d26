"""Fan-out over hosts: every selected host runs the same work in parallel, in waves; Ctrl-C stops it safely.

One `Transport` per host per command; a wave lets every host finish (like Fabric's groups; at most
`forks` hosts at once, as Ansible's `forks`), then the report says, host by host, what came back or
which error stopped it. `max_failures` stops later waves once too many hosts failed (a canary is
`--wave-size 1 --max-failures 0`); the caller says which results count as failures. Wave sizes and
failure limits are host counts or percentages, rounded as Ansible rounds `serial: 25%` and
`max_fail_percentage`. Every host not started gets a row that says why. `interruptible` turns
Ctrl-C into a flag the work polls at its safe points. `connecting` starts the first wave's
connections early, so that they overlap what a command still loads. Nothing here knows what a step
does.
"""

from __future__ import annotations

import getpass
import os
import signal
import socket
import threading
import traceback
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from ddtree_deploy.errors import DeployError
from ddtree_deploy.inventory import HostSpec, Inventory
from ddtree_deploy.transport import Transport, transport_for

R = TypeVar("R", bound=BaseModel)

DEFAULT_FORKS = 8  # Ansible's is 5; a host's work here is mostly waiting on its server, so a few more
INTERRUPTED = "interrupted (Ctrl-C)"
POLL_S = 0.25  # how soon the main thread runs a Ctrl-C handler that a signal to another thread left pending


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
    skip_reason: str = ""  # why a skipped host was never started

    @property
    def ok(self) -> bool:
        return self.error is None and not self.skipped


class FleetReport(BaseModel, Generic[R]):
    command: str
    hosts: list[HostRow[R]]
    interrupted: bool = False  # Ctrl-C came while the hosts ran

    @property
    def succeeded(self) -> list[HostRow[R]]:
        return [row for row in self.hosts if row.ok]

    @property
    def failed(self) -> list[HostRow[R]]:
        return [row for row in self.hosts if not row.ok]


class Amount(BaseModel):
    """A number of hosts (`3`) or a whole percentage of them (`25%`), as Ansible writes `serial: 25%`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    value: int = Field(ge=0)
    percent: bool = False

    @model_validator(mode="before")
    @classmethod
    def _from_plain(cls, data: Any) -> Any:
        """`3`, `"3"` and `"25%"` as well as the model's own fields (options are written either way)."""
        if isinstance(data, (int, str)) and not isinstance(data, bool):
            return cls.fields_of(str(data))
        return data

    @staticmethod
    def fields_of(text: str) -> dict[str, Any]:
        """The fields of `N` or `N%`; the ValueError (a usage error to click) names what was given and what is wanted.

        A `PydanticCustomError`, so that pydantic (and Typer, which coerces through it) shows the
        message alone, not prefixed with "Value error, ".
        """
        number = text.strip().removesuffix("%")
        if not (number.isascii() and number.isdigit()):
            raise PydanticCustomError("amount", f"{text!r}: give a number of hosts (3) or a whole percentage (25%)")
        value, percent = int(number), text.strip().endswith("%")
        if percent and value > 100:
            raise PydanticCustomError("amount", f"{text!r}: a percentage is 0% to 100%")
        return {"value": value, "percent": percent}

    @classmethod
    def parse(cls, text: Any) -> Amount:
        """A command line's `N` or `N%` (an `Amount` passes through: click converts defaults too)."""
        return text if isinstance(text, Amount) else cls(**cls.fields_of(str(text)))

    def __str__(self) -> str:
        return f"{self.value}%" if self.percent else str(self.value)


ALL_AT_ONCE = Amount(value=0)  # the wave size that makes one wave of every host


class FleetOptions(BaseModel):
    accept_new_host_key: bool = False
    wave_size: Amount = Field(default=ALL_AT_ONCE, description="hosts per wave, or a percentage of the fleet "
                              "(rounded down, at least 1, as Ansible's `serial`); 0 = all at once")
    max_failures: Amount | None = Field(default=None, description="start no further wave once more hosts than this "
                                        "failed, or more than this percentage of the wave just finished "
                                        "(Ansible's `max_fail_percentage`)")
    forks: int = Field(default=DEFAULT_FORKS, ge=1, description="hosts at once within a wave (Ansible's `forks`)")

    def wave_length(self, hosts: int) -> int:
        """Hosts per wave out of `hosts`: a percentage rounds down but is at least 1, as Ansible's `serial`."""
        if self.wave_size.percent:
            return max(1, hosts * self.wave_size.value // 100)
        return self.wave_size.value or max(hosts, 1)


def operator(command: str) -> str:
    """Who is acting, recorded in locks and histories."""
    return f"{getpass.getuser()}@{socket.gethostname()} pid {os.getpid()} ({command})"


@contextmanager
def interruptible(on_interrupt: Callable[[int], None] | None = None) -> Iterator[threading.Event]:
    """While the block runs, Ctrl-C (SIGINT) sets the yielded event instead of raising KeyboardInterrupt.

    Work that polls the event stops at its next safe point; a KeyboardInterrupt raised wherever the
    main thread happens to be could cut a step short. Every further Ctrl-C does the same again: a
    step is never abandoned halfway (SIGQUIT, Ctrl-\\, still quits at once, leaving what a killed
    controller leaves). `on_interrupt(count)` hears each one. Off the main thread (where no handler
    can be set) the event is simply never set by a signal.
    """
    cancel = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield cancel
        return
    count = 0

    def handler(_signum: int, _frame: object) -> None:
        nonlocal count
        count += 1
        cancel.set()
        if on_interrupt is not None:
            on_interrupt(count)

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield cancel
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)


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
    first = hosts[:min(options.wave_length(len(hosts)), options.forks)]
    started = {h.name: transport_for(h, inventory.ssh, owner, options.accept_new_host_key) for h in first}
    with _sigint_blocked():  # the threads that start them inherit the mask (see `_block_sigint`)
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
    *,
    failure: Callable[[R], str | None] | None = None,
    cancel: threading.Event | None = None,
) -> FleetReport[R]:
    """Run `work` on every host, in waves, each host on its own transport; collect rows in host order.

    Args:
        started: transports from `connecting`; a host with one uses it (and takes it out).
        failure: what a result that counts as a failure was ("rolled back"), else None; a raised
            error always counts. `options.max_failures` counts these.
        cancel: once set (see `interruptible`), no further host or wave starts; those running
            finish, since `work` itself polls it at its safe points.
    """
    options = options or FleetOptions()
    owner = operator(command)
    started = started if started is not None else {}

    def transport(host: HostSpec) -> Transport:
        return started.pop(host.name, None) or transport_for(host, inventory.ssh, owner, options.accept_new_host_key)

    size = options.wave_length(len(hosts))
    rows: dict[str, HostRow[R]] = {}
    stop: str | None = None
    for number, first in enumerate(range(0, len(hosts), size), start=1):
        wave = hosts[first:first + size]
        stop = stop or (INTERRUPTED if cancel is not None and cancel.is_set() else None)
        if stop is not None:
            rows.update({h.name: HostRow[R](host=h.name, skipped=True, skip_reason=f"not started: {stop}")
                         for h in wave})
            continue
        with ThreadPoolExecutor(max_workers=min(options.forks, len(wave)), initializer=_block_sigint) as pool:
            futures = {h.name: pool.submit(_run_one, transport(h), work, cancel) for h in wave}
            _await(futures.values())
        rows.update({name: future.result() for name, future in futures.items()})
        stop = _limit_exceeded(number, [rows[h.name] for h in wave], list(rows.values()), options, failure)
    return FleetReport[R](command=command, hosts=[rows[h.name] for h in hosts],
                          interrupted=cancel is not None and cancel.is_set())


def _await(futures: Iterable[Future[Any]]) -> None:
    """Wait for every future, waking now and then: a Ctrl-C that the kernel gave another thread only
    runs its Python handler once the main thread is back in Python."""
    pending = set(futures)
    while pending:
        _done, pending = wait(pending, timeout=POLL_S)


def _run_one(transport: Transport, work: Callable[[Transport], R], cancel: threading.Event | None) -> HostRow[R]:
    host = transport.host
    try:
        if cancel is not None and cancel.is_set():  # queued behind `forks` when Ctrl-C came
            return HostRow[R](host=host.name, skipped=True, skip_reason=f"not started: {INTERRUPTED}")
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


def _limit_exceeded(
    number: int, wave: list[HostRow[R]], so_far: list[HostRow[R]], options: FleetOptions,
    failure: Callable[[R], str | None] | None,
) -> str | None:
    """Why no further wave may start, or None: a count limit counts every host so far, a percentage the
    wave just finished (more than N% of it failed, as Ansible's `max_fail_percentage`)."""
    limit = options.max_failures
    if limit is None:
        return None
    counted = wave if limit.percent else so_far
    failed = [f"{row.host} {what}" for row in counted if (what := _failure_of(row, failure))]
    exceeded = len(failed) * 100 > limit.value * len(wave) if limit.percent else len(failed) > limit.value
    if not exceeded:
        return None
    named = ", ".join(failed[:3]) + (f" and {len(failed) - 3} more" if len(failed) > 3 else "")
    return f"wave {number} exceeded --max-failures {limit} ({named})"


def _failure_of(row: HostRow[R], failure: Callable[[R], str | None] | None) -> str | None:
    if row.error is not None:
        return row.error.code.replace("_", " ")
    if row.result is not None and failure is not None:
        return failure(row.result)
    return None


def _block_sigint() -> None:
    """Keep SIGINT from this thread and from every process it starts (a signal mask survives fork and exec).

    A terminal's Ctrl-C reaches its whole foreground process group: local host helpers and ssh_config
    ProxyCommands are in it. Left alone, a helper would die in the middle of a transaction, or a
    ProxyCommand would drop the connection while the remote helper runs on. Only the controller's main thread decides what Ctrl-C means (`interruptible`).
    """
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


@contextmanager
def _sigint_blocked() -> Iterator[None]:
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
