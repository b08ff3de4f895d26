"""The two forms of an Ansible inventory file, INI and YAML, read into a `Tree` as Ansible's `ini` and
`yaml` plugins read them.

INI: `[group]` sections list hosts (`name[:port] key=value ...`, values read as Python literals
where they are ones), `[group:children]` list groups, `[group:vars]` hold one `key=value` a line,
and hosts before any section are `ungrouped`. It is not configparser's INI (host lines are no
`key = value`), hence this reader. YAML: groups of `hosts`, `children` and `vars` mappings.
"""

from __future__ import annotations

import ast
import re
import shlex
import warnings
from pathlib import Path
from typing import Any

from ddtree_deploy.ansible_inventory import HINT, AnsibleInventory, Layer, Tree, resolve
from ddtree_deploy.errors import InventoryError

_SECTION = re.compile(r"\[([^:\]\s]+)(?::(\w+))?\]\s*(?:[#;].*)?")
_GROUP_NAME = re.compile(r"([^:\]\s]+)\s*(?:[#;].*)?")
_KINDS = ("hosts", "children", "vars")  # of an INI section, and the keys of a YAML group


def read_ini(path: Path) -> AnsibleInventory:
    """An Ansible INI inventory and the vars folders beside it.

    Raises:
        InventoryError: naming the file and line (or the vars file) and what to do.
    """
    if path.suffix == ".toml":
        raise InventoryError(f"{path}: a TOML inventory is not read", hint="convert it to YAML: "
                             f"ansible-inventory -i {path} --list --yaml > hosts.yml")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise InventoryError(f"{path}: cannot read inventory ({getattr(exc, 'strerror', None) or exc})",
                             hint="pass --inventory PATH or set DDTREE_INVENTORY") from None
    tree, group, kind = Tree(path), "ungrouped", "hosts"
    declared = {"all", "ungrouped"}
    used: dict[str, str] = {}  # a group named in :vars or :children needs a section of its own
    for number, raw in enumerate(text.splitlines(), 1):
        line, where = raw.strip(), f"{path} line {number}"
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            group, kind = _section(line, where)
            tree.add_group(group)
            if kind == "vars":
                used.setdefault(group, where)
            else:
                declared.add(group)
        else:
            child = _entry(tree, group, kind, line, where)
            if child is not None:
                used.setdefault(child, where)
    for name, where in used.items():
        if name not in declared:
            raise InventoryError(f"{where}: group {name!r} is never declared",
                                 hint=f"add a [{name}] section (it may be empty) or fix the name")
    return resolve(tree)


def _section(line: str, where: str) -> tuple[str, str]:
    section = _SECTION.fullmatch(line)
    if section is None:
        raise InventoryError(f"{where}: invalid section header {line!r}",
                             hint="write [group], [group:children] or [group:vars], without spaces")
    if (section[2] or "hosts") not in _KINDS:
        raise InventoryError(f"{where}: section [{section[1]}:{section[2]}] has an unknown type",
                             hint="write [group], [group:children] or [group:vars]")
    return section[1], section[2] or "hosts"


def _entry(tree: Tree, group: str, kind: str, line: str, where: str) -> str | None:
    """One line of a section into `tree`; the child group's name for a `:children` line."""
    if kind == "hosts":
        pattern, variables = _host_line(line, where)
        tree.add_hosts(group, pattern, variables, where)
        return None
    if kind == "vars":
        key, equals, value = line.partition("=")
        if not equals:
            raise InventoryError(f"{where}: expected key=value in [{group}:vars], got {line!r}", hint=HINT)
        tree.add_vars(group, Layer(where, {key.strip(): _literal(value.strip())}))
        return None
    child = _GROUP_NAME.fullmatch(line)
    if child is None:
        raise InventoryError(f"{where}: expected a group name in [{group}:children], got {line!r}", hint=HINT)
    tree.add_child(group, child[1])
    return child[1]


def _host_line(line: str, where: str) -> tuple[str, dict[str, Any]]:
    """`pattern [key=value ...]`, split as a shell would (quotes keep spaces, `#` starts a comment)."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError as exc:
        raise InventoryError(f"{where}: cannot read the host line ({exc})", hint="close the quote") from None
    variables: dict[str, Any] = {}
    for word in words[1:]:
        key, equals, value = word.partition("=")
        if not equals:
            raise InventoryError(f"{where}: expected key=value after the host name, got {word!r}",
                                 hint="host variables are key=value; quote a value with spaces")
        variables[key] = _literal(value)
    return words[0], variables


def _literal(text: str) -> Any:
    """An INI value as Ansible reads it: the Python literal it spells (2222, True, {'a': 1}), else the text."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SyntaxWarning)
            value = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text
    if isinstance(value, (tuple, set)):
        return list(value)
    return text if isinstance(value, (complex, bytes)) else value


def read_yaml(path: Path, data: dict[str, Any]) -> AnsibleInventory:
    """An Ansible YAML inventory (`data`, already read from `path`) and its vars folders.

    Raises:
        InventoryError: naming the file, the group or host, and the key.
    """
    tree = Tree(path)
    for name, body in data.items():
        _yaml_group(tree, str(name), body)
    return resolve(tree)


def _yaml_group(tree: Tree, name: str, body: Any) -> None:
    where = f"{tree.path}: group {name}"
    tree.add_group(name)
    sections = _sections(body, where)
    if sections["vars"]:
        tree.add_vars(name, Layer(f"{where} vars", sections["vars"]))
    for pattern, variables in sections["hosts"].items():
        host_where = f"{tree.path}: host {pattern}"
        if variables is not None and not isinstance(variables, dict):
            raise InventoryError(f"{host_where}: variables must be a mapping, got {type(variables).__name__}",
                                 hint="write `name:` alone, or `name: {var: value}`")
        tree.add_hosts(name, str(pattern), variables or {}, host_where)
    for child, child_body in sections["children"].items():
        _yaml_group(tree, str(child), child_body)
        tree.add_child(name, str(child))


def _sections(body: Any, where: str) -> dict[str, dict[str, Any]]:
    """A YAML group's hosts, children and vars (each a mapping; a lone name stands for `{name: null}`)."""
    if body is None:
        body = {}
    if not isinstance(body, dict):
        raise InventoryError(f"{where}: must be a mapping of hosts, children and vars, got {type(body).__name__}",
                             hint=HINT)
    unknown = sorted(set(body) - set(_KINDS))
    if unknown:
        raise InventoryError(f"{where}: unknown key {unknown[0]!r}", hint="an Ansible group has hosts, children and vars")
    out: dict[str, dict[str, Any]] = {}
    for key in _KINDS:
        value = body.get(key) or {}
        out[key] = {value: None} if isinstance(value, str) and key != "vars" else value
        if not isinstance(out[key], dict):
            raise InventoryError(f"{where}: {key} must be a mapping, got {type(value).__name__}", hint=HINT)
    return out
