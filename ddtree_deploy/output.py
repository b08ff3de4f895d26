"""Rendering and exit codes: the `--json` envelope, rich output, and the options every command shares.

With `--json`, stdout holds exactly `{"data": ...}` or `{"error": {"code", "message", "hint"}}` and
stderr stays empty. Only command modules (under `commands/`) call into this; nothing below the CLI
renders anything.
"""

from __future__ import annotations

import enum
import functools
import inspect
import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, TypeVar, cast

import typer
from pydantic import BaseModel
from typer.core import TyperCommand, TyperGroup

from ddtree_deploy.errors import DeployError, UsageError
from ddtree_deploy.wording import elapsed

if TYPE_CHECKING:
    from rich.console import Console
    from rich.text import Text

    from ddtree_deploy.fleet import ErrorInfo

M = TypeVar("M", bound=BaseModel)

#: the program's name in usage lines and hints, however it was started (`python -m ddtree_deploy.cli` too)
PROG = "ddtree-deploy"


@functools.cache
def _console(stderr: bool) -> Console:
    from rich.console import Console  # imported on first use: a --json run never needs rich

    # Off a terminal (CI logs, pipes) rich would wrap at 80 columns; a wider page keeps tables readable.
    width = None if sys.stdout.isatty() else 160
    return Console(stderr=stderr, highlight=False, width=width)


def __getattr__(name: str) -> Console:
    """`console` (stdout) and `err_console` (stderr): rich consoles, made when first used."""
    if name in ("console", "err_console"):
        return _console(stderr=name == "err_console")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class ExitCode(enum.IntEnum):
    """The exit codes of every command (documented in README.md)."""

    OK = 0  # done, or nothing to do
    FAILED = 1  # something failed; hosts were rolled back and are healthy (or a host was unreachable)
    BAD_INPUT = 2  # usage, inventory, overlay or playbook error; nothing was changed
    HOST_NEEDS_ATTENTION = 3  # a host is left unhealthy, locked, or with an open journal
    INTERRUPTED = 130  # Ctrl-C: each host stopped at a safe point; the report says how it ended


JsonOption = Annotated[bool, typer.Option("--json", help="Print only a JSON envelope on stdout.")]
HostOption = Annotated[list[str] | None, typer.Option("--host", "-H", metavar="NAME", help="Host name (repeatable).")]
GroupOption = Annotated[list[str] | None, typer.Option("--group", "-g", metavar="GROUP", help="Group name (repeatable).")]
AllOption = Annotated[bool, typer.Option("--all", help="Every host of the inventory.")]
InventoryOption = Annotated[
    str | None,
    typer.Option("--inventory", "-i", envvar="DDTREE_INVENTORY", metavar="PATH",
                 help="Inventory: ours (default ./inventory.yaml), or an Ansible one (hosts.ini, or YAML with all:)."),
]
AcceptNewHostKeyOption = Annotated[
    bool, typer.Option("--accept-new-host-key", help="Record host keys never seen before (never a changed one).")
]


class Command(TyperCommand):
    """A command whose help reads as written: paragraphs rewrapped, brackets shown, no `<bool>` metavars.

    Typer's rich help keeps a docstring's line breaks, reads `[@VERSION]` as markup (and drops it), and
    labels every option with its Python type (`--force <bool>`, `--host <list[str]>`). Every command
    and group of the CLI is made with this class or `Group`, so each help text is fixed once, here,
    when help is first shown (a run that shows none imports no rich).
    """

    def format_help(self, ctx: Any, formatter: Any) -> None:
        _readable_help(self)
        super().format_help(ctx, formatter)

    def get_params(self, ctx: Any) -> Any:  # every option, the help and completion ones included
        return [_readable_metavar(param) for param in super().get_params(ctx)]


class Group(TyperGroup):
    """`Command`'s help texts for a group of commands (the app, `overlay`), and its commands' in its list."""

    def format_help(self, ctx: Any, formatter: Any) -> None:
        for command in (self, *self.commands.values()):
            _readable_help(command)
        super().format_help(ctx, formatter)

    def get_params(self, ctx: Any) -> Any:  # every option, the help and completion ones included
        return [_readable_metavar(param) for param in super().get_params(ctx)]


def _readable_help(command: Any) -> None:
    """The command's own texts: its docstring rewrapped, every text shown as written (not rich markup)."""
    if getattr(command, "_help_readable", False):
        return
    command._help_readable = True
    if command.help:
        command.help = escape(reflow(command.help))
    for param in command.params:
        text = getattr(param, "help", None)
        if text:
            param.help = escape(text)


def _readable_metavar(param: Any) -> Any:
    """A flag shows no metavar; an option with a value its declared one, else its name (HOST)."""
    if getattr(param, "is_flag", False):
        param.metavar = ""
    elif param.metavar is None:
        param.metavar = (param.name or "value").upper()
    return param


def reflow(text: str) -> str:
    """A docstring's paragraphs, each on one line (the terminal wraps them)."""
    paragraphs = inspect.cleandoc(text).split("\n\n")
    return "\n\n".join(" ".join(line.strip() for line in p.splitlines()) for p in paragraphs)


def emit(result: BaseModel, *, as_json: bool, human: Callable[[Any], None], code: ExitCode = ExitCode.OK) -> NoReturn:
    """Print a result (envelope or rich) and exit with `code`."""
    if as_json:
        sys.stdout.write(json.dumps({"data": result.model_dump(mode="json")}) + "\n")
    else:
        human(result)
    raise typer.Exit(int(code))


def fail(error: DeployError, *, as_json: bool) -> NoReturn:
    """Print one error (envelope or one red line plus hint) and exit 2 for bad input, else 1 or 3."""
    print_error(error, as_json=as_json)
    raise typer.Exit(int(exit_code_for(error)))


def print_error(error: DeployError, *, as_json: bool) -> None:
    """The `{"error": ...}` envelope on stdout, or one red line on stderr with the hint below it."""
    if as_json:
        body = {"code": error.code, "message": str(error), "hint": error.hint}
        sys.stdout.write(json.dumps({"error": body}) + "\n")
    else:
        _console(stderr=True).print(f"[bold red]error[/]: {escape(str(error))}", soft_wrap=True)
        if error.hint:
            _console(stderr=True).print(f"  [dim]hint:[/] {escape(error.hint)}", soft_wrap=True)


#: click's UsageError (typer vendors click and exports only its subclass BadParameter)
_UsageError = cast("type[typer.TyperException]", typer.BadParameter.__mro__[1])


def run_app(app: typer.Typer, args: list[str]) -> int:
    """Run the app on `args` and return its exit code: the one place a usage error is rendered.

    A bad option or value (`status --jsn`, `push --wave-size x`) is bad input like any other: with
    `--json` anywhere before `--` it is the error envelope on stdout (code `usage`), with stderr
    empty; without, one line and a hint on stderr. Exit code 2 either way.
    """
    as_json = "--json" in (args[:args.index("--")] if "--" in args else args)
    try:
        code = app(args=args, prog_name=PROG, standalone_mode=False)
    except typer.TyperException as exc:  # click's own errors
        if type(exc).__name__ == "NoArgsIsHelpError":  # the help is printed already (typer checks it so too)
            return exc.exit_code
        if not isinstance(exc, _UsageError):
            print_error(DeployError(exc.format_message()), as_json=as_json)
            return exc.exit_code
        print_error(usage_error(exc), as_json=as_json)
        return int(ExitCode.BAD_INPUT)
    except typer.Abort:  # end of input at a prompt
        print_error(DeployError("aborted"), as_json=as_json)
        return int(ExitCode.FAILED)
    return code if isinstance(code, int) else 0


def usage_error(exc: typer.TyperException) -> UsageError:
    """click's usage error as ours: the message names the command, the hint its --help."""
    ctx = getattr(exc, "ctx", None)
    path = ctx.command_path if ctx is not None else PROG
    command = path.removeprefix(PROG).strip()
    message = exc.format_message()
    return UsageError(f"{command}: {message}" if command else message, code="usage", hint=f"see `{path} --help`")


def escape(text: str) -> str:
    """`text` shown as it is, never read as rich markup (a message may hold brackets: NAME[@VERSION])."""
    from rich.markup import escape as rich_escape  # imported on first use, like the consoles

    return rich_escape(text)


#: what a host that gave no answer is, by its error's code (any other code reads as itself)
NO_ANSWER = {
    "unreachable": "unreachable",
    "host_key_rejected": "host key refused",
    "package_not_found": "no sglang in {python}",
    "python_too_old": "{python} too old",
    "skipped": "not reached",
}


def no_answer(code: str, python: str = "its python") -> str:
    """A few words for a host row without a result: "host key refused", "no sglang in /usr/bin/python3"."""
    return NO_ANSWER.get(code, code.replace("_", " ")).format(python=python)


def print_host_error(host: str, error: ErrorInfo | None) -> None:
    """A host row without a result: its error in red, then the hint that `--json` carries."""
    message = error.message if error is not None else "skipped (stopped after earlier failures)"
    message = message.removeprefix(f"{host}: ")  # the row names the host already
    _console(stderr=False).print(f"[bold]{escape(host)}[/]: [red]{escape(message)}[/]", soft_wrap=True)
    if error is not None and error.hint:
        print_hint(error.hint)


def print_hint(hint: str) -> None:
    _console(stderr=False).print(f"  [dim]hint:[/] {escape(hint)}", soft_wrap=True)


def exit_code_for(error: DeployError) -> ExitCode:
    if error.bad_input:
        return ExitCode.BAD_INPUT
    if error.code in ("locked", "journal_open", "unhealthy"):
        return ExitCode.HOST_NEEDS_ATTENTION
    return ExitCode.FAILED


@contextmanager
def errors_rendered(as_json: bool) -> Iterator[None]:
    """The one error boundary: any `DeployError` escaping a command becomes `fail(...)`.

    Ctrl-C that reaches it (while the inventory is read, or a read-only query runs: a playbook's
    own handler stops its hosts at safe points and reports them itself) is said as one, exit 130,
    instead of Typer's silent exit.
    """
    try:
        yield
    except DeployError as exc:
        fail(exc, as_json=as_json)
    except KeyboardInterrupt:
        print_error(DeployError("interrupted (Ctrl-C)", code="interrupted",
                                hint="`ddtree-deploy status` shows where each host stands"), as_json=as_json)
        raise typer.Exit(int(ExitCode.INTERRUPTED)) from None


@contextmanager
def progress(message: str, as_json: bool) -> Iterator[None]:
    """A spinner on stderr for long operations (silent with --json or when stderr is not a terminal)."""
    if as_json or not _console(stderr=True).is_terminal:
        yield
        return
    with _console(stderr=True).status(message):
        yield


class StepProgress:
    """A spinner on stderr naming each host's current step and how long it has run (`ct200: restart 42 s`).

    Repainted as it spins, so a step that waits (a GPU server takes minutes to become ready) shows its
    seconds going up. Silent with --json or when stderr is not a terminal.
    """

    def __init__(self, enabled: bool, clock: Callable[[], float] = time.monotonic) -> None:
        self.enabled = enabled and _console(stderr=True).is_terminal
        self.clock = clock
        self.current: dict[str, tuple[str, float]] = {}
        self.lock = threading.Lock()
        self.status: Any = None

    def __enter__(self) -> StepProgress:
        if self.enabled:
            self.status = _console(stderr=True).status(self)  # rendered anew on every refresh: see __rich__
            self.status.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.status is not None:
            self.status.__exit__(None, None, None)

    def update(self, host: str, step: str) -> None:
        """`host` started `step` now (the playbook's progress callback)."""
        with self.lock:
            self.current[host] = (step, self.clock())

    def line(self) -> str:
        now = self.clock()
        with self.lock:
            steps = sorted(self.current.items())
        return " | ".join(f"{host}: {step} {elapsed(now - since)}" for host, (step, since) in steps) or "starting"

    def __rich__(self) -> Text:
        from rich.text import Text

        return Text(self.line())
