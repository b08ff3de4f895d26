"""Running the host helper on a host: one contract, an SSH transport and a local one.

`Transport.run_helper(op, args)` sends the stdlib-only helper (hostside/) plus one JSON request to
the host's own python and returns a `HelperResult` that keeps the evidence (op, exit code, answer,
stderr tail, duration). Nothing here knows what a snapshot is. No shell ever sees an inventory
value unquoted: the local transport uses no shell at all, the SSH one quotes every word.
"""

from __future__ import annotations

import abc
import base64
import hashlib
import json
import os
import shlex
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from functools import lru_cache
from importlib import resources
from typing import IO, TYPE_CHECKING, Any

from pydantic import BaseModel

from ddtree_deploy.errors import HelperError, HostKeyError, TransportError
from ddtree_deploy.runtime import private_folder

if TYPE_CHECKING:
    import paramiko
    from fabric import Connection

    from ddtree_deploy.inventory import HostSpec, SshSettings

HOSTSIDE_PACKAGE = "ddtree_deploy.hostside"


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
            self._session = None  # a forked child: the helper and its pipes belong to the parent
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


class SSHTransport(Transport):
    """A Fabric connection on an ssh_config alias, with strict host-key checking; warm hosts through a control master.

    The first command to reach a host connects with paramiko, which checks the host key strictly
    and names a refused key by its fingerprint. When it closes, it leaves an OpenSSH control master
    for that host (`ssh -M -N -f`, the same ssh_config and known_hosts, StrictHostKeyChecking=yes,
    `ssh.control_persist_s`), with its socket in the controller's private runtime folder. While that
    master lives, later commands open their sessions through it (`ssh -S`), skipping the TCP, key
    exchange and authentication that cost ~0.1 s of sshd CPU per host, as Ansible does with
    ControlPersist. A dead master is simply not used; a session started through one that dies on the
    way falls back to OpenSSH's own strict connection.
    """

    def __init__(self, host: HostSpec, ssh: SshSettings, owner: str = "", accept_new_host_key: bool = False) -> None:
        super().__init__(host, owner)
        self.ssh = ssh
        self.accept_new_host_key = accept_new_host_key
        self._conn: Connection | None = None
        self.muxed = False  # whether the helper's session went through a control master

    def _master_socket(self) -> str | None:
        """Where this host's control master listens (None: persistence off, or no ssh client, or no safe folder)."""
        if not self.ssh.control_persist_s or shutil.which("ssh") is None:
            return None
        folder = private_folder("ssh")
        if folder is None:
            return None
        key = json.dumps([self.host.ssh_alias, *self.host.ssh_options(), self.ssh.config, self._known_hosts(), os.getuid()])
        return str(folder / f"cm-{hashlib.sha256(key.encode()).hexdigest()[:16]}")

    def _known_hosts(self) -> str:
        return self.ssh.known_hosts or _default_known_hosts()

    def _openssh_options(self, socket_path: str) -> list[str]:
        config = ["-F", self.ssh.config] if self.ssh.config else []
        return [*config, "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
                "-o", f"UserKnownHostsFile={self._known_hosts()}", "-o", "HashKnownHosts=no",
                "-o", f"ConnectTimeout={max(1, round(self.ssh.connect_timeout_s))}", "-o", f"ControlPath={socket_path}",
                *self.host.ssh_options()]

    def _start_muxed(self, argv: list[str], socket_path: str) -> _Session:
        command = " ".join(shlex.quote(word) for word in argv)
        ssh = ["ssh", *self._openssh_options(socket_path), "-o", "ControlMaster=no", self.host.ssh_alias, "--", command]
        self.muxed = True
        return _spawn(ssh, self.host.name, "ssh_not_found", "install OpenSSH's client, or set ssh.control_persist_s: 0")

    def _leave_master(self) -> None:
        """Start a detached control master for the next commands, unless one is up (it outlives this process)."""
        socket_path = self._master_socket()
        if socket_path is None or _listening(socket_path):
            return
        master = ["ssh", *self._openssh_options(socket_path), "-o", "ControlMaster=yes",
                  "-o", f"ControlPersist={max(1, round(self.ssh.control_persist_s))}", "-N", "-f", self.host.ssh_alias]
        subprocess.Popen(master, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)

    def _connection(self) -> Connection:
        if self._conn is None:
            self._conn = self._open()
        return self._conn

    def _open(self) -> Connection:
        import paramiko
        from fabric import Config, Connection  # imported here: a local-only fleet needs no SSH stack

        config = Config(runtime_ssh_path=self.ssh.config) if self.ssh.config else Config()
        # The inventory's explicit ssh_user/ssh_port/ssh_key (Ansible's ansible_user & co.) win over ssh_config.
        conn = Connection(self.host.ssh_alias, user=self.host.ssh_user, port=self.host.ssh_port, config=config,
                          connect_timeout=self.ssh.connect_timeout_s,
                          connect_kwargs={"key_filename": [self.host.ssh_key]} if self.host.ssh_key else None)
        known_hosts = self._known_hosts()
        hop: object = conn
        while isinstance(hop, Connection):  # the host, then every ProxyJump gateway: all checked strictly
            self._strict(hop.client, known_hosts)
            hop = hop.gateway
        where = f"{conn.user}@{conn.host}:{conn.port}"
        try:
            conn.open()
        except paramiko.BadHostKeyException as exc:
            raise HostKeyError(
                f"host key CHANGED for {where}: expected {fingerprint(exc.expected_key)}, "
                f"got {fingerprint(exc.key)}",
                host=self.host.name,
                hint="if the host was reinstalled, verify the new key out of band, then remove the old line "
                     f"with `ssh-keygen -R '[{conn.host}]:{conn.port}' -f {known_hosts}`",
            ) from None
        except HostKeyError:
            raise
        except (TimeoutError, OSError, paramiko.SSHException) as exc:
            raise TransportError(f"cannot connect to {where}: {exc}", host=self.host.name,
                                 hint="check that the host is up and its ssh_config entry") from None
        return conn

    def _strict(self, client: paramiko.SSHClient, known_hosts: str) -> None:
        """Fabric installs AutoAddPolicy on every client it makes; replace it before anything connects."""
        if os.path.exists(known_hosts):
            client.load_host_keys(known_hosts)
        client.set_missing_host_key_policy(_strict_policy(self.host.name, known_hosts, self.accept_new_host_key))

    def _start(self, argv: list[str]) -> _Session:
        socket_path = self._master_socket()
        if socket_path is not None and _listening(socket_path):
            return self._start_muxed(argv, socket_path)
        transport = self._connection().client.get_transport()
        if transport is None:
            raise TransportError("ssh connection closed", host=self.host.name, hint="retry")
        channel = transport.open_session()
        channel.exec_command(" ".join(shlex.quote(word) for word in argv))
        return _SSHSession(channel)

    def close(self) -> None:
        super().close()
        if self._conn is not None:
            self._conn.close()
            self._conn = None
            self._leave_master()  # only after a connection that checked the host key and logged in


def _strict_policy(host: str, known_hosts: str, accept_new: bool) -> paramiko.MissingHostKeyPolicy:
    """Refuse unknown host keys with their fingerprint; record one only when told to (never a changed one:
    paramiko raises `BadHostKeyException` for those before any policy is asked)."""
    import paramiko

    class StrictPolicy(paramiko.MissingHostKeyPolicy):
        def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
            if not accept_new:
                raise HostKeyError(
                    f"unknown host key for {hostname}: {key.get_name()} {fingerprint(key)}",
                    host=host,
                    hint="verify the fingerprint out of band, then rerun with --accept-new-host-key to record it",
                )
            client.get_host_keys().add(hostname, key.get_name(), key)
            with open(known_hosts, "a") as f:
                f.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")

    return StrictPolicy()


def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH's SHA256 fingerprint form, as `ssh-keygen -lf` prints it."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def _listening(socket_path: str) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(socket_path)
    except OSError:
        return False
    finally:
        probe.close()
    return True


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
