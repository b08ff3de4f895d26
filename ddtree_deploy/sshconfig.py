"""What an ssh_config alias means: its address, user, keys and jump hosts, resolved as OpenSSH's client would.

`resolve(alias, config)` asks `ssh -G` when OpenSSH's client is installed, so `Include`, `Match`,
`%` tokens and OpenSSH's own defaults mean exactly what they mean to `ssh`. Without it, paramiko's
parser reads the same files (the user's config, then the system's; or only the inventory's), with
`Include` files inlined here since paramiko has no `Include`. The `SshTarget` says which served.
`DDTREE_DEPLOY_SSH_RESOLVER=paramiko` (or `openssh`) picks one instead of asking PATH. Host-key
settings of the file (`StrictHostKeyChecking`, `UserKnownHostsFile`) are never read: the transport
checks every hop's key itself, strictly, against the inventory's known_hosts.
"""

from __future__ import annotations

import getpass
import glob
import os
import re
import shutil
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ddtree_deploy.errors import InventoryError

Resolver = Literal["openssh", "paramiko"]
RESOLVER_ENV = "DDTREE_DEPLOY_SSH_RESOLVER"
USER_CONFIG = "~/.ssh/config"
SYSTEM_CONFIG = "/etc/ssh/ssh_config"
MAX_INCLUDE_DEPTH = 16  # OpenSSH's own limit on nested Include
_TOKEN = re.compile(r"%(.)")


@dataclass(frozen=True)
class SshTarget:
    """Where one alias (or one `ProxyJump` hop) leads, and through what."""

    alias: str
    hostname: str
    port: int
    user: str
    identity_files: tuple[str, ...]  # existing files only, tokens and ~ expanded, in ssh's order
    identities_only: bool
    proxy_jump: tuple[str, ...]  # hops as written ([user@]host[:port]), the first one reached first
    proxy_command: str | None  # tokens expanded; only when there is no ProxyJump (OpenSSH uses the first set)
    resolver: Resolver

    @property
    def address(self) -> str:
        return f"{self.user}@{self.hostname}:{self.port}"


def resolver() -> Resolver:
    """`openssh` when its client is on PATH (or asked for), else `paramiko`."""
    asked = os.environ.get(RESOLVER_ENV, "")
    if asked in ("openssh", "paramiko"):
        return asked  # type: ignore[return-value]  # narrowed by the test above
    if asked:
        raise InventoryError(f"{RESOLVER_ENV}={asked!r}: not a resolver", hint="use openssh or paramiko, or unset it")
    return "openssh" if shutil.which("ssh") else "paramiko"


def resolve(destination: str, config: str | None, *, host: str, user: str | None = None,
            port: int | None = None) -> SshTarget:
    """`destination` (an alias or a `ProxyJump` hop's host) as ssh would reach it.

    Args:
        config: the inventory's ssh_config file (as `ssh -F`), or None for the user's and the system's.
        host: the inventory host this is for, named in errors.
        user, port: a hop's own `user@` and `:port`, which win over the file (as `ssh -l/-p` do).
    Raises:
        InventoryError: the file cannot be read or OpenSSH refuses it (its own message).
    """
    which = resolver()
    values = (_openssh_values if which == "openssh" else _paramiko_values)(destination, config, host, user, port)
    return _target(destination, values, which)


def split_hop(hop: str) -> tuple[str, str | None, int | None]:
    """`[ssh://][user@]host[:port]` -> (host, user, port), as `ProxyJump` writes a hop."""
    rest = hop.removeprefix("ssh://")
    user, _, rest = rest.rpartition("@")
    host, _, port = rest.rpartition(":") if rest.count(":") == 1 else (rest, "", "")
    return host, user or None, int(port) if port.isdigit() else None


def _openssh_values(destination: str, config: str | None, host: str, user: str | None,
                    port: int | None) -> dict[str, list[str]]:
    argv = ["ssh", "-G", *(["-F", config] if config else []), *(["-l", user] if user else []),
            *(["-p", str(port)] if port else []), "--", destination]
    try:
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise InventoryError(f"cannot run `ssh -G {destination}`: {exc}", host=host, code="ssh_config_invalid",
                             hint=f"install OpenSSH's client, or set {RESOLVER_ENV}=paramiko") from None
    if proc.returncode != 0:
        why = [line for line in proc.stderr.splitlines() if "Pseudo-terminal" not in line][-1:] or ["no output"]
        raise InventoryError(f"ssh_config for {destination!r}: {why[0]}", host=host, code="ssh_config_invalid",
                             hint=f"fix the ssh_config file; `ssh -G {destination}` shows what OpenSSH reads")
    values: dict[str, list[str]] = {}
    for line in proc.stdout.splitlines():
        key, _, value = line.partition(" ")
        values.setdefault(key.lower(), []).append(value)
    return values


def _paramiko_values(destination: str, config: str | None, host: str, user: str | None,
                     port: int | None) -> dict[str, list[str]]:
    import paramiko  # only a controller without OpenSSH's client parses the file itself

    files = [config] if config else [USER_CONFIG, SYSTEM_CONFIG]
    try:
        text = "".join(_inlined(Path(os.path.expanduser(f)), must_exist=f == config, depth=0,
                                relative_to="/etc/ssh" if f == SYSTEM_CONFIG else "~/.ssh") for f in files)
        found = paramiko.SSHConfig.from_text(text).lookup(destination)
    except OSError as exc:
        raise InventoryError(f"cannot read ssh_config {exc.filename}: {exc.strerror}", host=host,
                             code="ssh_config_invalid", hint="fix ssh.config in the inventory") from None
    except paramiko.ConfigParseError as exc:
        raise InventoryError(f"ssh_config for {destination!r}: {exc}", host=host, code="ssh_config_invalid",
                             hint="fix the ssh_config file") from None
    values = {key: list(value) if isinstance(value, list) else [str(value)] for key, value in found.items()}
    values.update({"hostname": values.get("hostname", [destination]),
                   "user": [user] if user else values.get("user", [getpass.getuser()]),
                   "port": [str(port)] if port else values.get("port", ["22"])})
    return values


def _inlined(path: Path, *, must_exist: bool, depth: int, relative_to: str) -> str:
    """The file's text with each `Include` replaced by the files it names (globbed; a relative name is
    relative to ~/.ssh in a user's file, to /etc/ssh in the system's, as OpenSSH reads it)."""
    if not must_exist and not path.exists():
        return ""
    if depth > MAX_INCLUDE_DEPTH:
        raise OSError(0, f"Include nested deeper than {MAX_INCLUDE_DEPTH}", str(path))
    out = []
    for line in path.read_text().splitlines(keepends=True):
        words = line.split()
        if len(words) > 1 and words[0].lower() == "include":
            for pattern in words[1:]:
                full = os.path.join(os.path.expanduser(relative_to), os.path.expanduser(pattern))
                out += [_inlined(Path(p), must_exist=True, depth=depth + 1, relative_to=relative_to)
                        for p in sorted(glob.glob(full))]
        else:
            out.append(line if line.endswith("\n") else line + "\n")
    return "".join(out)


def _target(alias: str, values: dict[str, list[str]], which: Resolver) -> SshTarget:
    def first(key: str, default: str = "") -> str:
        return (values.get(key) or [default])[0]

    hostname, user, port = first("hostname", alias), first("user", getpass.getuser()), int(first("port", "22"))
    tokens = {"%": "%", "h": hostname, "p": str(port), "r": user, "n": alias, "u": getpass.getuser(),
              "d": os.path.expanduser("~"), "l": socket.gethostname().split(".")[0]}

    def expand(value: str) -> str:
        return _TOKEN.sub(lambda m: tokens.get(m.group(1), m.group(0)), value) if which == "openssh" else value

    jumps = tuple(h for h in first("proxyjump", "none").split(",") if h and h != "none")
    command = first("proxycommand", "none")
    identities = (os.path.expanduser(expand(f)) for f in values.get("identityfile", []))
    return SshTarget(alias=alias, hostname=hostname, port=port, user=user,
                     identity_files=tuple(f for f in identities if os.path.isfile(f)),
                     identities_only=first("identitiesonly", "no").lower() == "yes", proxy_jump=jumps,
                     proxy_command=expand(command) if command != "none" and not jumps else None, resolver=which)
