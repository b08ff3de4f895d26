"""Real OpenSSH servers on 127.0.0.1 serving simulated host trees: keys, sshd_config, ssh_config, known_hosts.

`start_fleet` builds host trees (sandbox/hosts.py) and starts one `sshd -D -e` per host on a free
loopback port, with host keys and a client key made for this run. A server that cannot start fails
the calling test with its log (`pytest.fail`); nothing here skips.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from sandbox.hosts import PROFILES, SandboxHost, build_host

SSHD = "/usr/sbin/sshd"
PRIVSEP_DIR = Path("/run/sshd")  # sshd refuses to start without its privilege separation directory
START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 5.0
FLEET_PROFILES = ("ct129", "ct200")


@dataclass
class Sshd:
    """One running sshd serving one simulated host."""

    name: str
    port: int
    folder: Path
    host_key: Path
    process: subprocess.Popen[bytes]

    @property
    def log(self) -> Path:
        return self.folder / "sshd.log"

    @property
    def public_key(self) -> str:
        """`ssh-ed25519 AAAA...` of this server."""
        return " ".join(self.host_key.with_suffix(".pub").read_text().split()[:2])

    def known_hosts_line(self) -> str:
        return f"[127.0.0.1]:{self.port} {self.public_key}\n"

    def fingerprint(self) -> str:
        """`SHA256:...`, as `ssh-keygen -lf` prints it."""
        out = _run(["ssh-keygen", "-lf", str(self.host_key.with_suffix(".pub"))])
        return out.split()[1]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@dataclass
class Fleet:
    """Simulated hosts behind their sshd, and the client-side files that reach them."""

    folder: Path
    client_key: Path
    hosts: dict[str, SandboxHost]
    servers: dict[str, Sshd]
    ssh_config: Path
    known_hosts: Path
    startup_s: dict[str, float] = field(default_factory=dict)

    def write_inventory(
        self,
        path: Path,
        *,
        state_base: Path | None = None,
        hosts: dict[str, dict[str, Any]] | None = None,
        ssh: dict[str, Any] | None = None,
    ) -> Path:
        """Write an inventory for this fleet at `path` (its folder is created).

        Args:
            state_base: give every host a new state base `<state_base>/<host>` instead of the tree's own.
            hosts: per-host keys merged over the generated ones (a new name adds a host).
            ssh: keys merged over the top-level `ssh:` block.
        """
        entries: dict[str, dict[str, Any]] = {}
        for name, host in self.hosts.items():
            entry = host.inventory_entry(ssh=name, groups=["eval"])
            if state_base is not None:
                entry["state_dir"] = str(state_base / name)
            entries[name] = entry
        for name, extra in (hosts or {}).items():
            entries[name] = {**entries.get(name, {}), **extra}
        doc = {"ssh": {"config": str(self.ssh_config), "known_hosts": str(self.known_hosts), "connect_timeout_s": 5,
                       **(ssh or {})},
               "hosts": entries}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return path

    def write_ssh_config(self, path: Path, extra: dict[str, int] | None = None,
                         jumps: dict[str, tuple[str, str]] | None = None) -> Path:
        """This fleet's ssh_config at `path`, plus more aliases.

        Args:
            extra: alias -> a 127.0.0.1 port (e.g. one where nothing listens).
            jumps: alias -> (host reached, alias of the jump host): a `ProxyJump` entry.
        """
        ports = {**{name: s.port for name, s in self.servers.items()}, **(extra or {})}
        text = "".join(ssh_config_entry(alias, port, self.client_key, self.known_hosts) for alias, port in ports.items())
        text += "".join(ssh_config_entry(alias, self.servers[target].port, self.client_key, self.known_hosts, via)
                        for alias, (target, via) in (jumps or {}).items())
        path.write_text(text)
        return path

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()


def _run(argv: list[str]) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout


def require_sshd() -> None:
    """Fail (never skip) with what to do when this machine cannot run the test servers."""
    if not os.access(SSHD, os.X_OK):
        pytest.fail(f"{SSHD} not found: the SSH integration tests need OpenSSH's server; "
                    "install it with `apt-get install -y openssh-server` (scripts/test.sh does)", pytrace=False)
    if os.geteuid() != 0:
        pytest.fail("the SSH integration tests run sshd as root (it must log the test client in as root); "
                    "run them as root, as CI does", pytrace=False)
    for tool in ("ssh-keygen",):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} not found: install openssh-client", pytrace=False)
    PRIVSEP_DIR.mkdir(mode=0o755, exist_ok=True)


def make_key(path: Path, comment: str) -> Path:
    """A new ed25519 key pair at `path` and `path.pub`."""
    _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)])
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_sshd(name: str, host: SandboxHost, folder: Path, client_key: Path) -> Sshd:
    """Start sshd for `host` in `folder` (a plain path: sshd_config cannot quote everything).

    The session gets the host's own HOME and its tools first on PATH, through symlinks in `folder`,
    since the host tree's own path may hold characters sshd_config cannot express. (A separate HOME
    is what a separate machine has; it also keeps this machine's ~/.bashrc out of every call.)
    """
    folder.mkdir(parents=True)
    host_key = make_key(folder / "ssh_host_ed25519_key", f"{name} host key")
    (folder / "authorized_keys").write_text(client_key.with_suffix(".pub").read_text())
    (folder / "bin").symlink_to(host.bin_dir)
    (folder / "home").symlink_to(host.home)
    last_error = ""
    for _attempt in range(5):  # a free port can be taken between our probe and sshd's bind
        port = free_port()
        config = folder / "sshd_config"
        config.write_text(_sshd_config(port, folder, host_key))
        with open(folder / "sshd.log", "wb") as log:
            process = subprocess.Popen([SSHD, "-D", "-e", "-f", str(config)], stdin=subprocess.DEVNULL,
                                       stdout=log, stderr=subprocess.STDOUT)
        server = Sshd(name=name, port=port, folder=folder, host_key=host_key, process=process)
        if _wait_ready(server):
            return server
        server.stop()
        last_error = server.log.read_text(errors="replace")[-2000:]
        if "Address already in use" not in last_error:
            break
    pytest.fail(f"sshd for {name} did not start; its log:\n{last_error}", pytrace=False)


def _sshd_config(port: int, folder: Path, host_key: Path) -> str:
    return f"""\
Port {port}
ListenAddress 127.0.0.1
HostKey {host_key}
PidFile none
AuthorizedKeysFile {folder}/authorized_keys
AllowUsers root
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
SetEnv PATH={folder}/bin:/usr/local/bin:/usr/bin:/bin HOME={folder}/home
MaxStartups 64:30:128
MaxSessions 64
Subsystem sftp internal-sftp
LogLevel VERBOSE
"""


def _wait_ready(server: Sshd) -> bool:
    """True once the server sends its SSH banner; False at once if it exited (no waiting out a dead process)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            return False
        try:
            with socket.create_connection(("127.0.0.1", server.port), timeout=1) as sock:
                if sock.recv(64).startswith(b"SSH-2.0-"):
                    return True
        except OSError:
            time.sleep(0.01)
    return False


def ssh_config_entry(alias: str, port: int, client_key: Path, known_hosts: Path, jump: str | None = None) -> str:
    proxy = f"  ProxyJump {jump}\n" if jump else ""
    return f"""\
Host {alias}
  HostName 127.0.0.1
  Port {port}
  User root
  IdentityFile {client_key}
  IdentitiesOnly yes
  UserKnownHostsFile {known_hosts}
  StrictHostKeyChecking yes
{proxy}
"""


def start_fleet(folder: Path, profiles: tuple[str, ...] = FLEET_PROFILES,
                host_roots: dict[str, Path] | None = None) -> Fleet:
    """Build host trees and start one sshd per host; the caller stops the fleet.

    Args:
        folder: a new folder for keys, server files and client files (a plain path).
        profiles: host names, each one of `sandbox.hosts.PROFILES`.
        host_roots: where to build a host tree instead of `<folder>/hosts/<name>` (any characters).
    """
    require_sshd()
    folder.mkdir(parents=True, exist_ok=True)
    client_key = make_key(folder / "client_ed25519", "ddtree-deploy test client")
    known_hosts = folder / "known_hosts"
    fleet = Fleet(folder=folder, client_key=client_key, hosts={}, servers={},
                  ssh_config=folder / "ssh_config", known_hosts=known_hosts)
    try:
        for name in profiles:
            started = time.monotonic()
            root = (host_roots or {}).get(name, folder / "hosts" / name)
            fleet.hosts[name] = build_host(root, PROFILES[name].name, name=name)
            built = time.monotonic()
            fleet.servers[name] = start_sshd(name, fleet.hosts[name], folder / "sshd" / name, client_key)
            fleet.startup_s[f"{name} tree"] = built - started
            fleet.startup_s[f"{name} sshd"] = time.monotonic() - built
    except BaseException:
        fleet.stop()
        raise
    known_hosts.write_text("".join(s.known_hosts_line() for s in fleet.servers.values()))
    fleet.write_ssh_config(fleet.ssh_config)
    return fleet
