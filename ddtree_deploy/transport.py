"""Running the host helper on a host: one contract, an SSH transport and a local one.

`Transport.run_helper(op, args)` sends the stdlib-only helper (hostside/) plus one JSON request to
the host's own python and returns a `HelperResult` that keeps the evidence (op, exit code, answer,
stderr tail, duration). Nothing here knows what a snapshot is. No shell ever sees an inventory
value unquoted: the local transport uses no shell at all, the SSH one quotes every word.
"""

from __future__ import annotations

import abc
import base64
import dataclasses
import hashlib
import json
import os
import shlex
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import IO, TYPE_CHECKING, Any

from pydantic import BaseModel

from ddtree_deploy.errors import HelperError, HostKeyError, InventoryError, TransportError
from ddtree_deploy.sshconfig import Resolver, SshTarget, resolve, split_hop

if TYPE_CHECKING:
    import paramiko
    from fabric import Connection

    from ddtree_deploy.inventory import HostSpec, SshSettings

HOSTSIDE_PACKAGE = "ddtree_deploy.hostside"
MAX_JUMPS = 8  # ProxyJump hops on the way to one host, each hop's own ones included


class HelperResult(BaseModel):
    """One helper round trip, with its evidence."""

    host: str
    op: str
    exit_code: int
    answer: dict[str, Any] | None = None
    stderr_tail: str = ""
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and bool(self.answer and self.answer.get("ok"))

    @property
    def data(self) -> dict[str, Any]:
        """The op's answer; raises `HelperError` (naming host, op and code) if the op failed."""
        if self.ok:
            assert self.answer is not None
            return dict(self.answer.get("data") or {})
        raise self.error()

    def error(self) -> HelperError:
        if self.answer is None:
            tail = self.stderr_tail.strip().splitlines()[-1:] or ["no output"]
            return HelperError(f"helper op {self.op} failed (exit {self.exit_code}): {tail[0]}",
                               host=self.host, hint="run with the host's python by hand to see why", result=self)
        err = self.answer.get("error") or {}
        return HelperError(str(err.get("message", "unknown error")), host=self.host,
                           code=str(err.get("code", "helper_failed")), hint=str(err.get("hint", "")),
                           result=self, details=dict(err.get("details") or {}))


class _Session(abc.ABC):
    """One helper process on a host, answering one JSON line per request line."""

    @abc.abstractmethod
    def send(self, data: bytes) -> None:
        """Write to the helper's stdin (raises OSError once it is gone)."""

    @abc.abstractmethod
    def receive(self) -> bytes:
        """One line from the helper's stdout; b"" once it has exited."""

    @abc.abstractmethod
    def finish(self) -> tuple[int, bytes]:
        """Close stdin, wait for the helper; its exit code and stderr."""


class Transport(abc.ABC):
    """Runs the host helper on one host: one helper process per transport, one round trip per op.

    The helper starts on the first call (the host's python, the helper's sources on the first line)
    and then answers request lines; `close()` ends it. A python start per op would cost more than
    the op itself.
    """

    def __init__(self, host: HostSpec, owner: str = "") -> None:
        self.host = host
        self.owner = owner
        self._session: _Session | None = None
        self._session_pid = 0
        self._starting: threading.Thread | None = None
        self._start_error: Exception | None = None
        #: which resolver read the host's ssh_config (`SSHTransport`, once connected); None for local hosts
        self.ssh_resolver: Resolver | None = None

    def start(self) -> None:
        """Connect and start the helper in a background thread now; the first op waits for it.

        The connection and the host's python start then overlap whatever the controller still has
        to do before its first op (a CLI still importing, an overlay still loading). An error is
        raised by the first op, exactly as if it had connected itself.
        """
        if self._session is None and self._starting is None:
            self._starting = threading.Thread(target=self._start_in_background, name=f"start {self.host.name}",
                                              daemon=True)
            self._starting.start()

    def _start_in_background(self) -> None:
        try:
            self._begin()
        except Exception as exc:  # kept for the first op to raise, in its own thread
            self._start_error = exc

    def _await_start(self) -> None:
        if self._starting is None:
            return
        self._starting.join()
        self._starting = None
        error, self._start_error = self._start_error, None
        if error is not None:
            raise error

    def run_helper(self, op: str, args: dict[str, Any] | None = None) -> HelperResult:
        request = {"op": op, "args": args or {}, "package_root": self.host.package_root,
                   "state_base": self.host.state_dir, "owner": self.owner}
        self._await_start()
        started = time.monotonic()
        if self._session is not None and self._session_pid != os.getpid():
            self._session = None  # a forked child (the crash tests fork one): the helper's pipes are the parent's
        session = self._session or self._begin()
        try:
            session.send(json.dumps(request).encode() + b"\n")
            line = session.receive()
        except OSError:
            line = b""
        answer = _parse_answer(line)
        exit_code, stderr = 0, b""
        if answer is None or (answer.get("error") or {}).get("code") == "python_too_old":
            exit_code, stderr = self._end()  # the helper is gone: keep its evidence, start anew next time
        return HelperResult(host=self.host.name, op=op, exit_code=exit_code, answer=answer,
                            stderr_tail=stderr.decode(errors="replace")[-4000:],
                            duration_s=time.monotonic() - started)

    def call(self, op: str, args: dict[str, Any] | None = None) -> dict[str, Any]:
        """`run_helper(...).data`: the answer, or the op's error raised."""
        return self.run_helper(op, args).data

    def _begin(self) -> _Session:
        argv = [self.host.python, "-c", bootstrap_source()]
        if self.host.env:  # `env` keeps the values plain argv words, quoted like every other word
            argv = ["env", *(f"{k}={v}" for k, v in self.host.env.items()), *argv]
        session = self._start(argv)
        try:
            session.send(json.dumps({"modules": hostside_modules(), **hostside_bytecode()}).encode() + b"\n")
        except OSError:
            pass  # it died at once (no such python, too old): the first receive tells
        self._session, self._session_pid = session, os.getpid()
        return session

    def _end(self) -> tuple[int, bytes]:
        session, self._session = self._session, None
        return session.finish() if session is not None else (0, b"")

    @abc.abstractmethod
    def _start(self, argv: list[str]) -> _Session:
        """Start argv on the host with pipes to it."""

    def close(self) -> None:
        """End the helper (and the connection, for transports that hold one)."""
        try:
            self._await_start()
        except Exception:  # a start that failed left nothing to end; its error was for the first op
            pass
        self._end()


class _LocalSession(_Session):
    def __init__(self, proc: subprocess.Popen[bytes], stderr: IO[bytes]) -> None:
        self.proc, self.stderr = proc, stderr

    def send(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def receive(self) -> bytes:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline()

    def finish(self) -> tuple[int, bytes]:
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                try:
                    pipe.close()
                except BrokenPipeError:  # it died with our request unread (e.g. no such python on the host)
                    pass
        code = self.proc.wait()
        self.stderr.seek(0)
        data = self.stderr.read()
        self.stderr.close()
        return code, data


def _spawn(argv: list[str], host: str, code: str, hint: str) -> _LocalSession:
    stderr = tempfile.TemporaryFile()  # a file, not a pipe: nobody has to drain it while ops run
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr)
    except OSError as exc:
        stderr.close()
        raise TransportError(f"cannot run {argv[0]!r}: {exc.strerror}", host=host, code=code, hint=hint) from None
    return _LocalSession(proc, stderr)


class LocalTransport(Transport):
    """This machine, through subprocess, with no shell."""

    def _start(self, argv: list[str]) -> _Session:
        return _spawn(argv, self.host.name, "python_not_found", "fix the host's python in the inventory")


class _SSHSession(_Session):
    def __init__(self, channel: paramiko.Channel) -> None:
        self.channel = channel
        self.stdout = channel.makefile("rb")

    def send(self, data: bytes) -> None:
        try:
            self.channel.sendall(data)
        except EOFError:
            raise OSError("helper channel closed") from None

    def receive(self) -> bytes:
        return bytes(self.stdout.readline())

    def finish(self) -> tuple[int, bytes]:
        try:
            self.channel.shutdown_write()
        except OSError:
            pass
        code = self.channel.recv_exit_status()
        err = bytearray()
        while self.channel.recv_stderr_ready():
            err += self.channel.recv_stderr(1 << 16)
        self.channel.close()
        return code, bytes(err)


@dataclass
class _Hop:
    """One connection on the way to a host: a jump host, or the host itself (the last hop)."""

    conn: Connection
    label: str  # how errors name it: `root@10.0.0.5:22`, or `jump host bastion (root@10.0.0.1:22)`
    proxy_command: str | None


class SSHTransport(Transport):
    """Fabric connections on an ssh_config alias, resolved as OpenSSH would, with strict host keys on every hop.

    The alias, and each `ProxyJump` hop, is resolved by `sshconfig` (`ssh -G`, else paramiko's
    parser); `ssh_resolver` says which served. A gateway `Connection` per hop carries the next one,
    and every hop's client gets the strict policy and the inventory's known_hosts before it connects,
    so nothing in ssh_config (say `StrictHostKeyChecking no` for a bastion) loosens a check. A
    refused key is named by its hop and fingerprint. One connection per command: nothing outlives it.
    """

    def __init__(self, host: HostSpec, ssh: SshSettings, owner: str = "", accept_new_host_key: bool = False) -> None:
        super().__init__(host, owner)
        self.ssh = ssh
        self.accept_new_host_key = accept_new_host_key
        self._hops: list[_Hop] = []  # opened, first jump host first; the last one is the host

    def _known_hosts(self) -> str:
        return self.ssh.known_hosts or _default_known_hosts()

    def _connection(self) -> Connection:
        if not self._hops:
            # The inventory's explicit ssh_user/ssh_port/ssh_key (Ansible's ansible_user & co.) win over ssh_config.
            target = resolve(self.host.ssh_alias, self.ssh.config, host=self.host.name,
                             user=self.host.ssh_user, port=self.host.ssh_port)
            if self.host.ssh_key:
                target = dataclasses.replace(target, identity_files=(self.host.ssh_key, *target.identity_files))
            self.ssh_resolver = target.resolver
            hops = self._chain(target, target.address, depth=0)
            try:
                for hop in hops:  # from the first jump host on, so that an error names the hop it came from
                    self._open(hop)
            except BaseException:
                for hop in reversed(hops):  # never keep a jump host that a retry could take for the host
                    hop.conn.close()
                raise
            self._hops = hops
        return self._hops[-1].conn

    def _chain(self, target: SshTarget, label: str, depth: int) -> list[_Hop]:
        """Strict, unopened Connections: the ProxyJump hops to `target` (each the next one's gateway), then `target`."""
        if depth > MAX_JUMPS:
            raise InventoryError(f"ProxyJump of {self.host.ssh_alias!r} goes more than {MAX_JUMPS} hops deep",
                                 host=self.host.name, code="ssh_config_invalid", hint="look for a ProxyJump loop")
        before = self._jumps(target.proxy_jump, depth) if target.proxy_jump else []
        conn = self._strict_connection(target, label, gateway=before[-1].conn if before else None)
        return [*before, _Hop(conn=conn, label=label, proxy_command=target.proxy_command)]

    def _jumps(self, hops: tuple[str, ...], depth: int) -> list[_Hop]:
        """The last hop, reached through the ones before it (the first through its own ProxyJump, as ssh -J does)."""
        name, user, port = split_hop(hops[-1])
        target = resolve(name, self.ssh.config, host=self.host.name, user=user, port=port)
        if len(hops) > 1:
            target = dataclasses.replace(target, proxy_jump=hops[:-1], proxy_command=None)
        return self._chain(target, f"jump host {name} ({target.address})", depth + 1)

    def _strict_connection(self, target: SshTarget, label: str, gateway: Connection | None) -> Connection:
        from fabric import Config, Connection  # imported here: a local-only fleet needs no SSH stack
        from paramiko import SSHConfig

        auth: dict[str, Any] = {"key_filename": list(target.identity_files)}
        if target.identities_only:
            auth.update(allow_agent=False, look_for_keys=False)
        conn = Connection(target.hostname, user=target.user, port=target.port, gateway=gateway,
                          config=Config(ssh_config=SSHConfig(), lazy=True),  # no file may change what was resolved
                          connect_timeout=self.ssh.connect_timeout_s, connect_kwargs=auth)
        known_hosts = self._known_hosts()
        if os.path.exists(known_hosts):
            conn.client.load_host_keys(known_hosts)
        # Fabric installs AutoAddPolicy on every client it makes; replace it before anything connects.
        conn.client.set_missing_host_key_policy(
            _strict_policy(self.host.name, label, known_hosts, self.accept_new_host_key))
        return conn

    def _open(self, hop: _Hop) -> None:
        import paramiko

        conn = hop.conn
        if hop.proxy_command:
            conn.connect_kwargs["sock"] = paramiko.ProxyCommand(hop.proxy_command)
        try:
            conn.open()
        except paramiko.BadHostKeyException as exc:
            raise HostKeyError(
                f"host key CHANGED for {hop.label}: expected {fingerprint(exc.expected_key)}, got {fingerprint(exc.key)}",
                host=self.host.name,
                hint="if the host was reinstalled, verify the new key out of band, then remove the old line "
                     f"with `ssh-keygen -R '{_known_hosts_name(conn.host, conn.port)}' -f {self._known_hosts()}`",
            ) from None
        except HostKeyError:
            raise
        except (TimeoutError, OSError, paramiko.SSHException) as exc:
            raise TransportError(f"cannot connect to {hop.label}: {exc}", host=self.host.name,
                                 hint="check that the host is up and its ssh_config entry") from None

    def _start(self, argv: list[str]) -> _Session:
        transport = self._connection().client.get_transport()
        if transport is None:
            raise TransportError("ssh connection closed", host=self.host.name, hint="retry")
        channel = transport.open_session()
        channel.exec_command(" ".join(shlex.quote(word) for word in argv))
        return _SSHSession(channel)

    def close(self) -> None:
        super().close()
        hops, self._hops = self._hops, []
        for hop in reversed(hops):  # the host, then each gateway it was reached through
            hop.conn.close()


def _strict_policy(host: str, label: str, known_hosts: str, accept_new: bool) -> paramiko.MissingHostKeyPolicy:
    """Refuse unknown host keys, naming the hop and the fingerprint; record one only when told to (never a
    changed one: paramiko raises `BadHostKeyException` for those before any policy is asked)."""
    import paramiko

    class StrictPolicy(paramiko.MissingHostKeyPolicy):
        def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
            if not accept_new:
                raise HostKeyError(
                    f"unknown host key for {label}: {key.get_name()} {fingerprint(key)}",
                    host=host,
                    hint="verify the fingerprint out of band, then rerun with --accept-new-host-key to record it "
                         f"(as {hostname} in {known_hosts})",
                )
            client.get_host_keys().add(hostname, key.get_name(), key)
            with open(known_hosts, "a") as f:
                f.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")

    return StrictPolicy()


def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH's SHA256 fingerprint form, as `ssh-keygen -lf` prints it."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def _known_hosts_name(hostname: str, port: int) -> str:
    """How known_hosts names a host: `[host]:port`, or the bare host on port 22."""
    return hostname if port == 22 else f"[{hostname}]:{port}"


def _default_known_hosts() -> str:
    return os.path.expanduser("~/.ssh/known_hosts")


def _parse_answer(stdout: bytes) -> dict[str, Any] | None:
    try:
        answer = json.loads(stdout)
    except ValueError:
        return None
    return answer if isinstance(answer, dict) else None


@lru_cache(maxsize=1)
def hostside_modules() -> dict[str, str]:
    """Sources of the helper's modules, by module name (bootstrap excluded: it travels as `-c`)."""
    folder = resources.files(HOSTSIDE_PACKAGE)
    return {
        entry.name[:-3]: entry.read_text()
        for entry in folder.iterdir()
        if entry.name.endswith(".py") and entry.name not in ("__init__.py", "bootstrap.py")
    }


@lru_cache(maxsize=1)
def hostside_bytecode() -> dict[str, Any]:
    """This python's bytecode of the helper's modules and its magic number, for a host python that reads it."""
    import importlib.util
    import marshal

    code = {name: base64.b64encode(marshal.dumps(compile(source, name + ".py", "exec"))).decode()
            for name, source in hostside_modules().items()}
    return {"magic": base64.b64encode(importlib.util.MAGIC_NUMBER).decode(), "bytecode": code}


@lru_cache(maxsize=1)
def bootstrap_source() -> str:
    return resources.files(HOSTSIDE_PACKAGE).joinpath("bootstrap.py").read_text()


def transport_for(host: HostSpec, ssh: SshSettings, owner: str = "", accept_new_host_key: bool = False) -> Transport:
    if host.transport == "local":
        return LocalTransport(host, owner)
    return SSHTransport(host, ssh, owner, accept_new_host_key)
