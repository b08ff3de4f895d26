"""The CLI's commands, one module per verb (or verb group); `register_all` adds them to the app."""

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
    ("history", "history"),
    ("abi", "abi"),
    ("logs", "logs"),
    ("unlock", "unlock"),
]
GROUPS: list[tuple[str, str]] = [
    ("overlay", "overlay"),
]


def register_all(app: typer.Typer) -> None:
    for module_name, name in COMMANDS:
        module = importlib.import_module(f"ddtree_deploy.commands.{module_name}")
        app.command(name)(getattr(module, name))
    for module_name, name in GROUPS:
        module = importlib.import_module(f"ddtree_deploy.commands.{module_name}")
        app.add_typer(module.app, name=name)
