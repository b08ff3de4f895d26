"""The CLI's commands, one module per verb (or verb group); `register` adds them to the app."""

from __future__ import annotations

import importlib

import typer

#: (module, command name) for plain commands; modules exposing `app` are added as groups.
COMMANDS = [
    ("status", "status"),
    ("push", "push"),
    ("rollback", "rollback"),
    ("restart", "restart"),
    ("restart", "stop"),
    ("play", "play"),
    ("diff", "diff"),
    ("snapshots", "snapshots"),
    ("prune", "prune"),
    ("history", "history"),
    ("abi", "abi"),
    ("logs", "logs"),
    ("unlock", "unlock"),
]
GROUPS: list[tuple[str, str]] = [
    ("overlay", "overlay"),
]


def register(app: typer.Typer, verb: str | None = None) -> None:
    """Add every command and group to `app`, or only `verb`'s when it names one.

    A command module imports what its command needs, so a run that names its verb imports only
    that; anything else (no verb, `--help`, a typo) gets every command, for help and errors.
    """
    commands = [(m, n) for m, n in COMMANDS if n == verb]
    groups = [(m, n) for m, n in GROUPS if n == verb]
    if not commands and not groups:
        commands, groups = COMMANDS, GROUPS
    for module_name, name in commands:
        module = importlib.import_module(f"ddtree_deploy.commands.{module_name}")
        app.command(name)(getattr(module, name))
    for module_name, name in groups:
        module = importlib.import_module(f"ddtree_deploy.commands.{module_name}")
        app.add_typer(module.app, name=name)
