"""Ansible inventories read as ours: groups, hosts and variables (a `Tree`, which ansible_formats.py fills
from the INI or YAML file), the `group_vars/` and `host_vars/` folders beside the file, and precedence.

All is read as Ansible's inventory and `host_group_vars` plugins read it. Each host comes back with its
variable layers in Ansible's order (which `inventory.merge_host_layers` documents), translated into
our host keys: `ansible_host`, `_user`, `_port`, `_ssh_private_key_file`, `_python_interpreter` and
`_connection` become `ssh_host`, `ssh_user`, `ssh_port`, `ssh_key`, `python` and `transport`; the
`ddtree_deploy` variable holds our other keys, and `ddtree_deploy_ssh` (on the `all` group only) the
`ssh:` settings. Other variables are Ansible's business. inventory.py merges and validates the layers.
"""

from __future__ import annotations

import ipaddress
import re
import string
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from ddtree_deploy.errors import InventoryError
from ddtree_deploy.yamlfile import read_mapping

OUR_VAR = "ddtree_deploy"
SSH_VAR = "ddtree_deploy_ssh"
#: the names Ansible gives vars files, in the order it looks for them
_VARS_SUFFIXES = (".yml", ".yaml", ".json")
#: older names first, so that the newer one wins where a layer sets both
_CONNECTION_VARS = {
    "ansible_ssh_host": "ssh_host", "ansible_host": "ssh_host",
    "ansible_ssh_user": "ssh_user", "ansible_user": "ssh_user",
    "ansible_ssh_port": "ssh_port", "ansible_port": "ssh_port",
    "ansible_ssh_private_key_file": "ssh_key", "ansible_private_key_file": "ssh_key",
    "ansible_python_interpreter": "python",
}
_TRANSPORTS = {"ssh": "ssh", "paramiko": "ssh", "smart": "ssh", "local": "local"}
_RANGE = re.compile(r"\[([0-9A-Za-z]*):([0-9A-Za-z]+)(?::([1-9][0-9]*))?\]")
HINT = "see the Ansible inventory section of README.md"


class _AnsibleLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """YAML as Ansible writes it: `!unsafe` values are plain strings, `!vault` ones keep their (unreadable) text."""


for _tag in ("!unsafe", "!vault"):
    _AnsibleLoader.add_constructor(_tag, lambda loader, node: loader.construct_scalar(node))


class Layer(NamedTuple):
    """Host keys from one place, and that place: a file, with its line, group or host where known."""

    source: str
    values: dict[str, Any]


@dataclass
class AnsibleHost:
    name: str
    layers: list[Layer]  # lowest precedence first; the first holds its groups


@dataclass
class AnsibleInventory:
    hosts: dict[str, AnsibleHost]
    ssh: list[Layer]  # `ddtree_deploy_ssh` of the `all` group, lowest first


@dataclass
class _Group:
    parents: list[str] = field(default_factory=list)
    hosts: list[str] = field(default_factory=list)
    vars: list[Layer] = field(default_factory=list)  # the inventory file's, translated
    files: list[Layer] = field(default_factory=list)  # group_vars/'s, translated
    priority: int = 1  # ansible_group_priority: orders groups of one depth


@dataclass
class Tree:
    """An Ansible inventory as its file says it, before the vars folders and the precedence."""

    path: Path
    groups: dict[str, _Group] = field(default_factory=lambda: {"all": _Group(), "ungrouped": _Group()})
    host_vars: dict[str, list[Layer]] = field(default_factory=dict)
    ssh: list[Layer] = field(default_factory=list)

    def add_group(self, name: str) -> None:
        self.groups.setdefault(name, _Group())

    def add_child(self, parent: str, child: str) -> None:
        self.add_group(child)
        if parent not in self.groups[child].parents:
            self.groups[child].parents.append(parent)

    def add_hosts(self, group: str, pattern: str, variables: dict[str, Any], where: str) -> None:
        """The hosts a pattern names (`name`, `name:port`, ranges as in `www[01:50].example.com`) join `group`."""
        names, port = _expand(pattern, where)
        for name in names:
            values = variables if port is None else {**variables, "ansible_port": port}
            self.host_vars.setdefault(name, []).append(_translated(Layer(where, values), group=None))
            if name not in self.groups[group].hosts:
                self.groups[group].hosts.append(name)

    def add_vars(self, group: str, layer: Layer, *, file: bool = False) -> None:
        if "ansible_group_priority" in layer.values:
            try:
                self.groups[group].priority = int(layer.values["ansible_group_priority"])
            except (TypeError, ValueError):
                raise InventoryError(f"{layer.source}: ansible_group_priority must be a whole number", hint=HINT) from None
        if group == "all" and SSH_VAR in layer.values:
            self.ssh.append(Layer(layer.source, layer.values[SSH_VAR]))
        (self.groups[group].files if file else self.groups[group].vars).append(_translated(layer, group=group))


def _expand(pattern: str, where: str) -> tuple[list[str], int | None]:
    """Ansible's host patterns: `name`, `name:port`, and ranges as in `www[01:50].example.com` or `db-[a:f]`."""
    if not pattern or pattern.endswith(":") or pattern == "---":
        raise InventoryError(f"{where}: {pattern!r} is not a host name", hint="an INI inventory holding YAML? "
                             "name a YAML inventory .yaml or .yml")
    name, port = pattern, None
    head, colon, tail = pattern.rpartition(":")
    if colon and tail.isdigit() and ":" not in re.sub(r"\[[^\]]*\]", "", head):  # not an IPv6 address
        name, port = head, int(tail)
    return _ranges(name, where), port


def _ranges(name: str, where: str) -> list[str]:
    match = _RANGE.search(name)
    if match is None:
        if "[" in name or "]" in name:
            raise InventoryError(f"{where}: host range in {name!r} is not [begin:end] or [begin:end:step]",
                                 hint="write ranges as www[01:50].example.com or db-[a:f].example.com")
        return [name]
    begin, end, step = match[1] or "0", match[2], int(match[3] or 1)
    if begin.isdigit() and end.isdigit() and int(begin) <= int(end):
        width = len(begin) if begin.startswith("0") else 0  # [01:50] keeps two digits
        if width and len(end) != width:
            raise InventoryError(f"{where}: host range [{begin}:{end}] pads its begin but not its end",
                                 hint="give both ends the same width, e.g. [01:50]")
        items = [str(i).zfill(width) for i in range(int(begin), int(end) + 1, step)]
    elif len(begin) == len(end) == 1 and begin.isalpha() and end.isalpha() and begin <= end:
        letters = string.ascii_letters
        items = list(letters[letters.index(begin):letters.index(end) + 1:step])
    else:
        raise InventoryError(f"{where}: host range [{match[0][1:-1]}] must run up, over numbers or single letters",
                             hint="write ranges as www[01:50].example.com or db-[a:f].example.com")
    return [out for item in items for out in _ranges(name[:match.start()] + item + name[match.end():], where)]


def _translated(layer: Layer, *, group: str | None) -> Layer:
    """A layer of Ansible variables as our host keys (within one layer, `ddtree_deploy`'s keys win)."""
    values = layer.values
    if SSH_VAR in values and group != "all":
        raise InventoryError(f"{layer.source}: {SSH_VAR} holds inventory-wide settings",
                             hint="set it on the all group: group_vars/all.yml or [all:vars]")
    ours = {key: values[var] for var, key in _CONNECTION_VARS.items() if var in values}
    if "ansible_connection" in values:
        if values["ansible_connection"] not in _TRANSPORTS:
            raise InventoryError(f"{layer.source}: ansible_connection {values['ansible_connection']!r} is not one "
                                 "ddtree-deploy speaks", hint=f"use one of {', '.join(_TRANSPORTS)}")
        ours["transport"] = _TRANSPORTS[values["ansible_connection"]]
    own = values.get(OUR_VAR) or {}
    if not isinstance(own, dict):
        raise InventoryError(f"{layer.source}: {OUR_VAR} must be a mapping of host keys, got {type(own).__name__}",
                             hint="e.g. ddtree_deploy: {service: {kind: process, ...}}, as a host in inventory.yaml")
    return Layer(layer.source, {**ours, **own})


def resolve(tree: Tree) -> AnsibleInventory:
    """Every host with its layers, in Ansible's order: the `all` group, the host's other groups by depth
    (then priority, then name), the inventory file's vars before `group_vars/`, then the host's own vars,
    then `host_vars/`.

    Raises:
        InventoryError: a vars file that cannot be read, a bad variable, a cycle of children.
    """
    depth = _depths(tree)
    folder = tree.path.parent
    member: dict[str, list[str]] = {}  # host -> the groups that list it, `all` and `ungrouped` aside
    for name, group in tree.groups.items():
        for layer in _vars_files(folder / "group_vars", name):
            tree.add_vars(name, layer, file=True)
        for host in group.hosts if name not in ("all", "ungrouped") else ():
            member.setdefault(host, []).append(name)
    hosts = {}
    for name, own in tree.host_vars.items():
        groups = sorted(_ancestors(tree, member.get(name, [])) or {"ungrouped"},
                        key=lambda g: (depth[g], tree.groups[g].priority, g))
        base = {"groups": groups, **({"ssh_host": name} if _is_address(name) else {})}
        layers = [Layer(str(tree.path), base), *tree.groups["all"].vars,
                  *(layer for g in groups for layer in tree.groups[g].vars), *tree.groups["all"].files,
                  *(layer for g in groups for layer in tree.groups[g].files), *own,
                  *(_translated(layer, group=None) for layer in _vars_files(folder / "host_vars", name))]
        hosts[name] = AnsibleHost(name, layers)
    return AnsibleInventory(hosts=hosts, ssh=tree.ssh)


def _depths(tree: Tree) -> dict[str, int]:
    """Each group's distance from `all` along its longest chain of parents; a cycle is an error."""
    depth: dict[str, int] = {}

    def visit(name: str, trail: tuple[str, ...]) -> int:
        if name in trail:
            raise InventoryError(f"{tree.path}: group {name!r} is its own ancestor ({' -> '.join((*trail, name))})",
                                 hint="remove one of those children entries")
        if name not in depth:
            parents = tree.groups[name].parents or ([] if name == "all" else ["all"])
            depth[name] = 1 + max(visit(p, (*trail, name)) for p in parents) if parents else 0
        return depth[name]

    for name in tree.groups:
        visit(name, ())
    return depth


def _ancestors(tree: Tree, groups: list[str]) -> set[str]:
    """The groups and all their parents, `all` aside."""
    found: set[str] = set()
    todo = list(groups)
    while todo:
        name = todo.pop()
        if name not in found and name != "all":
            found.add(name)
            todo += tree.groups[name].parents
    return found


def _vars_files(folder: Path, name: str) -> list[Layer]:
    """`group_vars/<name>` or `host_vars/<name>` as Ansible finds it: the first of `<name>` (a file, or a folder
    whose files are read in sorted order), `<name>.yml`, `<name>.yaml`, `<name>.json`."""
    for candidate in (folder / name, *(folder / f"{name}{suffix}" for suffix in _VARS_SUFFIXES)):
        if candidate.is_dir():
            return [_vars_file(path) for path in _folder_files(candidate)]
        if candidate.is_file():
            return [_vars_file(candidate)]
    return []


def _folder_files(folder: Path) -> Iterator[Path]:
    for entry in sorted(folder.iterdir()):
        if entry.name.startswith(".") or entry.name.endswith("~"):
            continue
        if entry.is_dir():
            yield from _folder_files(entry)
        elif entry.suffix in ("", *_VARS_SUFFIXES):
            yield entry


def _vars_file(path: Path) -> Layer:
    """One vars file; a file encrypted whole with ansible-vault is read as empty (our keys are no secrets)."""
    try:
        with open(path, "rb") as f:
            if f.read(14) == b"$ANSIBLE_VAULT":
                return Layer(str(path), {})
    except OSError:
        pass  # read_mapping names the file and why
    return Layer(str(path), read_mapping(path, InventoryError, what="Ansible vars file", read_hint=HINT,
                                         loader=_AnsibleLoader))


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True
