"""The options every fleet command shares (--host, --group, --all, --inventory, --accept-new-host-key), as one value.

`@fleet_command()` gives a command function those options and calls it with them gathered in one
`Selection`, so a command declares only its own options and a shared one is added in one place (as
click applications stack a shared-options decorator).
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ddtree_deploy import output as out
from ddtree_deploy.fleet import FleetOptions
from ddtree_deploy.inventory import HostSpec, Inventory, load_inventory, select_hosts

Command = Callable[..., None]


@dataclass(frozen=True)
class Selection:
    """Which hosts a command acts on, and how it reaches them."""

    hosts: list[str] | None = None  #: --host, repeatable
    groups: list[str] | None = None  #: --group, repeatable
    all_hosts: bool = False  #: --all
    inventory: str | None = None  #: --inventory (else $DDTREE_INVENTORY, else ./inventory.yaml)
    accept_new_host_key: bool = False  #: --accept-new-host-key

    def load(self, *, default_all: bool = False) -> tuple[Inventory, list[HostSpec]]:
        """The inventory and the hosts selected in it (every host when none is named and `default_all`)."""
        inv = load_inventory(self.inventory)
        hosts = select_hosts(inv, names=self.hosts, groups=self.groups, all_hosts=self.all_hosts,
                             default_all=default_all)
        return inv, hosts

    def fleet_options(self, **settings: Any) -> FleetOptions:
        """How to fan out over the selected hosts: this selection's host-key rule plus `settings`."""
        return FleetOptions(accept_new_host_key=self.accept_new_host_key, **settings)


#: each shared option's parameter name -> (the Selection field it fills, its annotated type, its default)
OPTIONS: dict[str, tuple[str, Any, Any]] = {
    "host": ("hosts", out.HostOption, None),
    "group": ("groups", out.GroupOption, None),
    "all_hosts": ("all_hosts", out.AllOption, False),
    "inventory": ("inventory", out.InventoryOption, None),
    "accept_new_host_key": ("accept_new_host_key", out.AcceptNewHostKeyOption, False),
}


def fleet_command(*, only: tuple[str, ...] = tuple(OPTIONS)) -> Callable[[Command], Command]:
    """Give a command that takes `selection: Selection` the shared options (or `only` those named).

    Typer reads a command's options from its signature: the one made here lists the command's
    arguments, then the shared options, then the command's own options.
    """

    def decorate(command: Command) -> Command:
        hints = typing.get_type_hints(command, include_extras=True)
        own = [p.replace(annotation=hints[p.name], kind=inspect.Parameter.KEYWORD_ONLY)
               for p in inspect.signature(command).parameters.values() if p.name != "selection"]
        shared = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=OPTIONS[name][2],
                                    annotation=OPTIONS[name][1]) for name in only]
        parameters = [*(p for p in own if p.default is p.empty), *shared, *(p for p in own if p.default is not p.empty)]

        @functools.wraps(command)
        def run(**values: Any) -> None:
            selection = Selection(**{OPTIONS[name][0]: values.pop(name) for name in only})
            command(selection=selection, **values)

        run.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
        run.__annotations__ = {p.name: p.annotation for p in parameters}
        return run

    return decorate
