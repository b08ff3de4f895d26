"""The fleet as inventory.yaml (or an Ansible inventory) describes it: pydantic models, loading, host selection.

The precedence of host keys is written once, in `merge_host_layers`. The inventory path comes from
`--inventory`, else `DDTREE_INVENTORY`, else `./inventory.yaml`. Nothing here opens a connection.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from ddtree_deploy.errors import InventoryError, UsageError
from ddtree_deploy.probes import ProbeSpec
from ddtree_deploy.yamlfile import first_problem, read_mapping

if TYPE_CHECKING:
    from ddtree_deploy.ansible_inventory import AnsibleInventory

M = TypeVar("M", bound=BaseModel)

ALIAS = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
HOST = re.compile(r"[A-Za-z0-9_:][A-Za-z0-9_.:%-]*")  # names, IPv4, IPv6 (with a zone): never an ssh option
USER = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.@$-]*")
DEFAULT_INVENTORY = "inventory.yaml"
INVENTORY_ENV = "DDTREE_INVENTORY"
#: Ansible reads files named so as YAML (any other as INI, or TOML); so do we (INI, no TOML)
YAML_SUFFIXES = (".yaml", ".yml", ".json")
#: a layer of host keys and where it was written (a file, with its line, group or host where known)
Source = tuple[str, Mapping[str, Any]]
DEFAULT_FATAL_PATTERNS = [
    r"^Traceback \(most recent call last\):",
    r"CUDA error",
    r"out of memory",
    # SGLang's subprocesses report their own crashes as one line that the anchored pattern misses.
    r"(Scheduler|TokenizerManager|DetokenizerManager|DataParallelController) hit an exception",
    r"Received sigquit from a child process",
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ProcessService(_Strict):
    """A server the tool starts itself, detached, in its own process group."""

    kind: Literal["process"] = "process"
    command: list[str] = Field(min_length=1, description="argv of the server, e.g. [python3, -m, sglang.launch_server]")
    args: list[str] = Field(default_factory=list, description="base launch arguments; the overlay's server.args follow")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment for the server")
    cwd: str | None = Field(default=None, description="working directory (default: the state directory)")
    port: int = Field(ge=1, le=65535, description="port the server listens on, on the host's loopback")
    ready_path: str = Field(default="/health_generate", description="GET path that answers 200 once ready")
    ready_timeout_s: float = Field(default=600.0, gt=0, description="longest wait for readiness of a live server")
    poll_interval_s: float = Field(default=0.25, ge=0.05, le=0.5)
    stop_grace_s: float = Field(default=30.0, ge=0, description="SIGTERM to SIGKILL grace period")
    fatal_patterns: list[str] = Field(default_factory=lambda: list(DEFAULT_FATAL_PATTERNS))


class SystemdService(_Strict):
    """A server managed by a systemd unit."""

    kind: Literal["systemd"]
    unit: str = Field(min_length=1)
    port: int = Field(ge=1, le=65535)
    args: list[str] = Field(default_factory=list, description="recorded only; the unit owns its command line")
    ready_path: str = "/health_generate"
    ready_timeout_s: float = Field(default=600.0, gt=0)
    poll_interval_s: float = Field(default=0.25, ge=0.05, le=0.5)
    fatal_patterns: list[str] = Field(default_factory=lambda: list(DEFAULT_FATAL_PATTERNS))


ServiceSpec = Annotated[ProcessService | SystemdService, Field(discriminator="kind")]


class HostSpec(_Strict):
    """One host of the fleet, after its layers are merged (`merge_host_layers`)."""

    name: str
    transport: Literal["ssh", "local"] = "ssh"
    # Explicit connection fields, as Ansible's ansible_host/_user/_port/_ssh_private_key_file set them;
    # declared before `ssh` so that its check sees them.
    ssh_host: str | None = Field(default=None, description="address or name to connect to instead of the ssh alias "
                                 "(ssh_config is matched against it, as ssh does with Ansible's ansible_host)")
    ssh_user: str | None = Field(default=None, description="login user, over ssh_config's User")
    ssh_port: int | None = Field(default=None, ge=1, le=65535, description="port, over ssh_config's Port")
    ssh_key: str | None = Field(default=None, min_length=1,
                                description="private key file, over ssh_config's IdentityFile (relative to the inventory)")
    ssh: str | None = Field(default=None, validate_default=True,
                            description="ssh_config alias (default: the host's name); never a raw IP")
    python: str = Field(description="the python of the environment that holds sglang")
    package_root: str | None = Field(default=None, description="site-packages folder holding sglang (default: discovered)")
    state_dir: str = Field(default="~/.local/state/ddtree-deploy", description="base of the host's state")
    groups: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict, description="environment of the host helper (like Ansible's environment:)")
    service: ServiceSpec | None = None
    probes: list[ProbeSpec] = Field(default_factory=list)

    @property
    def ssh_alias(self) -> str:
        """What ssh is given as the destination: `ssh_host`, else the ssh_config alias, else the name."""
        return self.ssh_host or self.ssh or self.name

    @field_validator("ssh_host", "ssh_user", mode="after")
    @classmethod
    def _never_an_option(cls, value: str | None, info: ValidationInfo) -> str | None:
        """What ssh is given as a host or a login name: never a word it could read as an option."""
        pattern, what = {"ssh_host": (HOST, "a host name or an address (not starting with -)"),
                         "ssh_user": (USER, "a login name (letters, digits, . _ - @ $, not starting with -)")}[
                             str(info.field_name)]
        if value is not None and not pattern.fullmatch(value):
            raise ValueError(f"{info.field_name} {value!r}: give {what}")
        return value

    @field_validator("ssh", mode="after")
    @classmethod
    def _alias_is_an_alias(cls, value: str | None, info: ValidationInfo) -> str | None:
        """An ssh_config alias (the host's name by default), not an address, never read by `ssh` as an option."""
        if info.data.get("ssh_host"):
            if value:
                raise ValueError("give ssh (an ssh_config alias) or ssh_host (an address or name), not both")
            return value
        alias = value or str(info.data.get("name", ""))
        if info.data.get("transport", "ssh") == "ssh":
            if not ALIAS.fullmatch(alias):
                raise ValueError(f"ssh alias {alias!r}: use a plain ssh_config Host name (letters, digits, . _ -, "
                                 "not starting with -)")
            if _is_address(alias):
                raise ValueError(f"ssh alias {alias!r} is an address: name the host in ssh_config and use that alias")
        return value


def _is_address(alias: str) -> bool:
    try:
        ipaddress.ip_address(alias)
    except ValueError:
        return False
    return True


class SshSettings(_Strict):
    config: str | None = Field(default=None, description="ssh_config file (default: ~/.ssh/config)")
    known_hosts: str | None = Field(default=None, description="known_hosts file (default: ~/.ssh/known_hosts)")
    connect_timeout_s: float = 10.0
    control_persist_s: None = Field(default=None, exclude=True,
                                    description="removed; given at all, it is refused (see the validator)")

    @field_validator("control_persist_s", mode="before")
    @classmethod
    def _control_persist_removed(cls, value: object) -> None:
        """Refused rather than ignored: whoever set it expected a warm connection that no longer exists."""
        raise ValueError("removed: ddtree-deploy keeps no SSH control masters any more (one connection per "
                         "command); delete this key")


class Inventory(_Strict):
    path: Path
    ssh: SshSettings = Field(default_factory=SshSettings)
    hosts: dict[str, HostSpec]

    def groups(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for host in self.hosts.values():
            for group in host.groups:
                out.setdefault(group, []).append(host.name)
        return out


_TOP_KEYS = {"ssh", "defaults", "hosts"}
_ANSIBLE_HINT = ("our keys go under the ddtree_deploy variable (python: ansible_python_interpreter), "
                 "see the Ansible inventory section of README.md")


def inventory_path(explicit: str | None) -> Path:
    return Path(explicit or os.environ.get(INVENTORY_ENV) or DEFAULT_INVENTORY)


def load_inventory(explicit: str | None = None) -> Inventory:
    """Read and validate the inventory (ours, or an Ansible one); every error names the file, the host and the field.

    A file named other than .yaml/.yml/.json is an Ansible INI inventory, and a YAML one without
    our top-level keys is an Ansible YAML inventory, as Ansible itself tells them apart.
    """
    path = inventory_path(explicit)
    if path.suffix not in YAML_SUFFIXES:
        from ddtree_deploy.ansible_formats import read_ini  # imported here: most fleets need no Ansible reader

        return _from_ansible(path, read_ini(path))
    raw = read_mapping(path, InventoryError, what="inventory",
                       read_hint=f"pass --inventory PATH or set {INVENTORY_ENV}")
    if raw and not _TOP_KEYS & set(raw):  # Ansible's shape: top-level groups (all: hosts: children:)
        from ddtree_deploy.ansible_formats import read_yaml

        return _from_ansible(path, read_yaml(path, raw))
    unknown = set(raw) - _TOP_KEYS
    if unknown:
        raise InventoryError(
            f"{path}: unknown top-level key {sorted(unknown)[0]!r}",
            hint=f"allowed keys: {', '.join(sorted(_TOP_KEYS))}",
        )
    defaults = _mapping(raw.get("defaults") or {}, path, "defaults")
    hosts_raw = _mapping(raw.get("hosts") or {}, path, "hosts")
    if not hosts_raw:
        raise InventoryError(f"{path}: no hosts defined", hint="add a 'hosts:' mapping of name -> settings")
    hosts = {}
    for name, spec in hosts_raw.items():
        own = _mapping(spec or {}, path, f"host {name}")
        hosts[str(name)] = _host(path, str(name), [("defaults", defaults), (f"hosts.{name}", own)])
    ssh = _validated(SshSettings, _mapping(raw.get("ssh") or {}, path, "ssh"), path, "ssh")
    return Inventory(path=path, ssh=_resolve_ssh_paths(ssh, path.parent), hosts=hosts)


def _mapping(value: Any, path: Path, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InventoryError(f"{path}: {where} must be a mapping, got {type(value).__name__}",
                             hint="see the inventory section of README.md")
    return value


def _from_ansible(path: Path, parsed: AnsibleInventory) -> Inventory:
    from ddtree_deploy.ansible_inventory import SSH_VAR

    if not parsed.hosts:
        raise InventoryError(f"{path}: no hosts defined", hint="add hosts under a [group] section, or under all: hosts:")
    hosts = {name: _host(path, name, host.layers, hint=_ANSIBLE_HINT) for name, host in parsed.hosts.items()}
    for layer in parsed.ssh:
        _mapping(layer.values, Path(layer.source), SSH_VAR)
    ssh = _validated(SshSettings, merge_host_layers([layer.values for layer in parsed.ssh]), path, SSH_VAR,
                     layers=parsed.ssh, hint=_ANSIBLE_HINT)
    return Inventory(path=path, ssh=_resolve_ssh_paths(ssh, path.parent), hosts=hosts)


def _host(path: Path, name: str, layers: Sequence[Source], hint: str = "") -> HostSpec:
    merged = merge_host_layers([values for _, values in layers])
    merged["name"] = name
    spec = _validated(HostSpec, merged, path, f"host {name}", host=name, layers=layers, hint=hint)
    return spec.model_copy(update={"ssh_key": _beside(spec.ssh_key, path.parent)})


def merge_host_layers(layers: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A host's keys from its layers, lowest precedence first: the one written precedence of the inventory.

    Lowest first:

    1. model defaults (the `HostSpec` and service field defaults, filled in by validation);
    2. group vars: inventory.yaml's `defaults:` block; in an Ansible inventory, as Ansible orders
       them: every group's vars in the inventory file, then every group's `group_vars/` files,
       each time the `all` group first, then the host's other groups parents before children
       (ties by `ansible_group_priority`, then name);
    3. host vars: the host's own keys (Ansible: inventory-file vars, then `host_vars/` files);
    4. playbook, `DDTREE_DEPLOY_*` variables and command-line flags: none of them sets a host key
       today (flags choose hosts and overlays, not host keys).

    A higher layer's mapping merges into a lower one key by key, at any depth (a host's
    `service: {port: 30001}` keeps the default service's command and kind), unless the two name a
    different `kind` (a systemd service replaces a process one whole). Lists and scalars replace,
    except the top-level `groups`, which add up: lower layers' groups first, each group once.
    `null` replaces too (`service: null` drops an inherited service).
    """
    merged: dict[str, Any] = {}
    for layer in layers:
        groups = merged.get("groups", [])
        merged = _deep_merge(merged, layer)
        if "groups" in layer:
            merged["groups"] = _added(groups, layer["groups"])
    return merged


def _deep_merge(low: Mapping[str, Any], high: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(low)
    for key, value in high.items():
        below = out.get(key)
        if isinstance(below, Mapping) and isinstance(value, Mapping) and _same_kind(below, value):
            out[key] = _deep_merge(below, value)
        else:
            out[key] = value
    return out


def _same_kind(below: Mapping[str, Any], value: Mapping[str, Any]) -> bool:
    """Mappings merge unless both name a kind and the kinds differ (a systemd unit is no process with a unit)."""
    return "kind" not in below or "kind" not in value or below["kind"] == value["kind"]


def _added(low: Any, high: Any) -> Any:
    """Groups of a lower layer, then a higher one's new ones; anything but two lists of names is left to validation."""
    if isinstance(low, list) and isinstance(high, list) and all(isinstance(g, str) for g in [*low, *high]):
        return list(dict.fromkeys([*low, *high]))
    return high


def _validated(model: type[M], data: dict[str, Any], path: Path, where: str, host: str | None = None,
               layers: Sequence[Source] = (), hint: str = "") -> M:
    """`model` from `data`; the error names the first bad field, and which of the `layers` merged into `data` set it."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        key = next(iter(exc.errors()[0]["loc"]), None)
        set_in = [source for source, values in layers if key in values]
        where_set = f" (set in {', '.join(set_in)})" if set_in else ""
        raise InventoryError(f"{path}: {where}: {first_problem(exc)}{where_set}", host=host,
                             hint=hint or "fix that field in the inventory; unknown keys are errors") from None


def _resolve_ssh_paths(ssh: SshSettings, base: Path) -> SshSettings:
    """Relative ssh file paths are relative to the inventory file, like Ansible's inventory-relative paths."""
    return ssh.model_copy(update={"config": _beside(ssh.config, base), "known_hosts": _beside(ssh.known_hosts, base)})


def _beside(p: str | None, base: Path) -> str | None:
    """A path as written in the inventory: `~` expanded, relative ones relative to the inventory's folder."""
    if p is None:
        return None
    expanded = Path(os.path.expanduser(p))
    return str(expanded if expanded.is_absolute() else (base / expanded).resolve())


def select_hosts(
    inventory: Inventory,
    *,
    names: list[str] | None = None,
    groups: list[str] | None = None,
    all_hosts: bool = False,
    default_all: bool = False,
) -> list[HostSpec]:
    """Resolve --host/--group/--all to host specs, in inventory order; unknown names list the known ones."""
    names, groups = names or [], groups or []
    if all_hosts or (default_all and not names and not groups):
        return list(inventory.hosts.values())
    if not names and not groups:
        raise UsageError("no hosts selected", hint="say which hosts: --host NAME, --group GROUP or --all")
    known_groups = inventory.groups()
    wanted: set[str] = set()
    for name in names:
        if name not in inventory.hosts:
            raise UsageError(f"unknown host {name!r} in {inventory.path}",
                             hint=f"known hosts: {', '.join(inventory.hosts)}")
        wanted.add(name)
    for group in groups:
        if group not in known_groups:
            raise UsageError(f"unknown group {group!r} in {inventory.path}",
                             hint=f"known groups: {', '.join(known_groups) or '(none)'}")
        wanted.update(known_groups[group])
    return [h for h in inventory.hosts.values() if h.name in wanted]
