"""The fork server: a controller that has already imported the CLI and forks one child per command.

A CLI run spends about a second of CPU importing typer, pydantic, paramiko and the steps' models
before it touches a host; on a 2-core controller that is a third of a warm push to four hosts. Like
OpenSSH's ControlPersist (which Ansible keeps on) and Python's multiprocessing forkserver, the first
command runs as usual and, as it exits, leaves a server behind (a command that finds it still
importing waits for it, up to STARTING_WAIT_S). Later commands connect to its unix socket and pass
their argv, environment, working folder, umask and stdio descriptors; the server forks a child that
runs the command exactly as the CLI process would, with those descriptors as its stdin/stdout/stderr.
The client relays SIGINT, SIGTERM, SIGHUP and SIGQUIT to the child's process group and exits with
the child's status; Ctrl-Z stops the child's group with the client, and `fg`/`bg` resume both. If
the client dies, even by SIGKILL, the server SIGKILLs that process group (the child and any local
host helper it started): a killed controller stays killed, which is what crash safety assumes.

The socket is keyed by the interpreter, `sys.path` (and the stamps of its folders, which change when a
package is installed) and the stamps of this package's files, so an edited checkout or an upgrade
never runs stale code. It lives in a folder only this user can open, and the server exits after
`DDTREE_DEPLOY_FORKSERVER_IDLE_S` seconds (default 300) without a command.
`DDTREE_DEPLOY_FORKSERVER=0` turns it off: every run then imports everything itself.

The client side runs before anything heavy is imported, so it uses the standard library only.
"""

from __future__ import annotations

import atexit
import fcntl
import hashlib
import json
import os
import selectors
import signal
import socket
import struct
import sys
import time
from pathlib import Path
from typing import Any

from ddtree_deploy import runtime

SWITCH = "DDTREE_DEPLOY_FORKSERVER"
IDLE_ENV = "DDTREE_DEPLOY_FORKSERVER_IDLE_S"
IDLE_S = 300.0
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
MAX_SOCKET_PATH = 100  # sun_path holds 108 bytes on Linux
LOG_LIMIT = 1 << 20
STARTING_WAIT_S = 3.0  # how long a client waits for a server that is still importing (~1 s on 2 cores)
HEADER = struct.Struct("!I")
PACKAGE_DIR = Path(__file__).resolve().parent


# ---------------------------------------------------------------- where the server lives


class Paths:
    """The socket, lock and log of the server for this interpreter, search path and code."""

    def __init__(self, folder: Path, key: str) -> None:
        self.socket = folder / f"fs-{key}.sock"
        self.lock = folder / f"fs-{key}.lock"
        self.log = folder / f"fs-{key}.log"


def enabled() -> bool:
    return os.environ.get(SWITCH, "1") != "0"


def server_paths() -> Paths | None:
    """This user's private folder and the current key; None where no safe folder can be had."""
    folder = runtime.private_folder()
    if folder is None:
        return None
    paths = Paths(folder, server_key())
    return paths if len(str(paths.socket)) <= MAX_SOCKET_PATH else None


def server_key() -> str:
    """Changes whenever the code a server imported could differ from what this run would import."""
    h = hashlib.sha256(f"{sys.executable}\0{sys.version}\0{os.getuid()}\0".encode())
    for entry in sys.path:
        h.update(f"{entry}\0{stamp(entry)}\0".encode())
    for folder, dirs, files in os.walk(PACKAGE_DIR):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                h.update(f"{path}\0{stamp(path)}\0".encode())
    return h.hexdigest()[:16]


def stamp(path: str) -> str:
    try:
        st = os.stat(path or ".")
    except OSError:
        return "-"
    return f"{st.st_mtime_ns}:{st.st_size}:{st.st_ino}"


# ---------------------------------------------------------------- client


def run_through_server(argv: list[str]) -> int | None:
    """The command's exit status when a warm server ran it; None when there is none (run it here).

    With no server up, one is started in the background as this process exits, so that it never
    competes with this command for the CPU. A server that is still importing (the previous command
    just started it) is waited for: its imports are already under way, and doing the same ones here
    would only double the CPU they take.
    """
    if not enabled() or not all(is_open(fd) for fd in (0, 1, 2)):
        return None  # a closed stdio descriptor cannot be passed: run here, as without a server
    paths = server_paths()
    if paths is None:
        return None
    sock = connect(paths)
    if sock is None:
        return None
    with sock:
        return ask(sock, argv)


def connect(paths: Paths) -> socket.socket | None:
    """A connection to the server, waiting up to STARTING_WAIT_S for one that is starting; None: run here."""
    deadline = time.monotonic() + STARTING_WAIT_S
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(str(paths.socket))
            return sock
        except OSError:
            sock.close()
        if not lock_is_held(paths.lock):  # no server at all, or one that has just exited
            atexit.register(start_server, paths)
            return None
        if time.monotonic() > deadline:
            return None  # a server that takes this long to start is not worth waiting for
        time.sleep(0.01)


def ask(sock: socket.socket, argv: list[str]) -> int | None:
    request = {
        "argv": argv,
        "cwd": os.getcwd(),
        "env": dict(os.environ),
        "umask": current_umask(),
        "encodings": [stream_encoding(s) for s in (sys.stdin, sys.stdout, sys.stderr)],
    }
    body = json.dumps(request).encode()
    message = HEADER.pack(len(body)) + body
    sent = socket.send_fds(sock, [message], [0, 1, 2])
    sock.sendall(message[sent:])
    answers = sock.makefile("rb")
    started = answers.readline()
    if not started.startswith(b"pid "):
        return None  # the server refused before forking: nothing ran, so run it here
    child = int(started.split()[1])
    for signum in FORWARDED:
        signal.signal(signum, lambda signum, _frame: forward(child, signum))
    signal.signal(signal.SIGTSTP, lambda _signum, _frame: suspend(child))
    signal.signal(signal.SIGCONT, lambda _signum, _frame: forward(child, signal.SIGCONT))
    finished = answers.readline()
    if not finished.startswith(b"exit "):
        sys.stderr.write(f"ddtree-deploy: the fork server went away while pid {child} ran the command\n")
        return 1
    return exit_code(int(finished.split()[1]))


def is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def stream_encoding(stream: Any) -> list[str]:
    return [getattr(stream, "encoding", None) or "utf-8", getattr(stream, "errors", None) or "strict"]


def forward(child: int, signum: int) -> None:
    try:
        os.killpg(child, signum)
    except ProcessLookupError:
        pass


def suspend(child: int) -> None:
    """Ctrl-Z: the terminal stops only this client, so stop the command's group too, then this client.

    The shell's `fg` or `bg` sends SIGCONT to this client, which passes it on (see `ask`).
    """
    forward(child, signal.SIGSTOP)
    os.kill(os.getpid(), signal.SIGSTOP)


def exit_code(status: int) -> int:
    """The child's exit code; a child killed by a signal kills this client with the same signal."""
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return 128 + signum
    return os.waitstatus_to_exitcode(status)


def start_server(paths: Paths) -> None:
    """Start a detached server unless one holds the lock already (it may still be importing)."""
    import subprocess  # only the first run of a while pays for this import

    if lock_is_held(paths.lock):
        return
    boot = "import json,sys; sys.path[:] = json.loads(sys.argv[1]); from ddtree_deploy.forkserver import serve; serve(sys.argv[2])"
    keep = paths.log.exists() and paths.log.stat().st_size < LOG_LIMIT  # a line per command: start afresh past it
    with open(paths.log, "ab" if keep else "wb") as log:
        subprocess.Popen(
            [sys.executable, "-c", boot, json.dumps(sys.path), str(paths.socket)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, close_fds=True,
        )


def lock_is_held(lock: Path) -> bool:
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return True  # cannot tell: do not start a second one
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # closing drops a lock we just took
    return False


# ---------------------------------------------------------------- server


def serve(socket_path: str) -> None:
    """Hold the lock, import the whole CLI, then fork a child per request until idle for IDLE_S."""
    paths = Paths(Path(socket_path).parent, Path(socket_path).name[3:-5])
    lock = os.open(paths.lock, os.O_RDWR | os.O_CREAT, 0o600)
    if not take_lock(lock):
        return  # another server for this key is up or starting
    os.ftruncate(lock, 0)
    os.write(lock, b"%d\n" % os.getpid())  # who holds it, for people and tests
    preload()
    server = Server(paths, float(os.environ.get(IDLE_ENV) or IDLE_S), lock)
    log(f"serving as pid {os.getpid()}")
    server.loop()
    log("idle: exiting")


def take_lock(lock: int) -> bool:
    """The server's lock, retried briefly: a waiting client's `lock_is_held` probe holds it for an instant."""
    for _ in range(20):
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError:
            time.sleep(0.01)
    return False


def preload() -> None:
    """Everything a command could import, so that no child pays for it."""
    import importlib
    import pkgutil

    import ddtree_deploy
    from ddtree_deploy import cli, transport

    for module in pkgutil.walk_packages(ddtree_deploy.__path__, "ddtree_deploy."):
        if ".hostside" not in module.name and module.name != __name__:
            importlib.import_module(module.name)
    for name in ("fabric", "paramiko", "rich.console", "rich.table", "rich.progress", "rich.text", "rich.live"):
        importlib.import_module(name)
    cli.build_app()
    transport.hostside_modules()
    transport.hostside_bytecode()
    transport.bootstrap_source()


class Server:
    """One listening socket; per request a forked child and the client connection that waits for it."""

    def __init__(self, paths: Paths, idle_s: float, lock: int) -> None:
        self.paths = paths
        self.lock = lock  # a child closes it: a command still running must not keep a new server out
        self.idle_s = idle_s
        self.selector = selectors.DefaultSelector()
        self.children: dict[int, socket.socket] = {}
        self.listener = self.bind()
        self.wake_read, wake_write = os.pipe()
        os.set_blocking(self.wake_read, False)
        os.set_blocking(wake_write, False)
        signal.set_wakeup_fd(wake_write)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # its only job: make the wakeup fd fire
        self.wake_write = wake_write
        self.selector.register(self.listener, selectors.EVENT_READ, self.accept)
        self.selector.register(self.wake_read, selectors.EVENT_READ, self.reap)

    def bind(self) -> socket.socket:
        """Bound under a temporary name, then renamed: a client never sees a socket nobody listens on."""
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        temp = f"{self.paths.socket}.{os.getpid()}"
        listener.bind(temp)
        listener.listen(16)
        os.replace(temp, self.paths.socket)
        self.inode = os.stat(self.paths.socket).st_ino
        return listener

    def loop(self) -> None:
        try:
            while True:
                events = self.selector.select(None if self.children else self.idle_s)
                if not events and not self.children:
                    return
                for key, _ in events:
                    key.data(key.fileobj)
        finally:
            self.close()

    def close(self) -> None:
        # The path goes first: a client that connected since the last accept then reads EOF before any
        # "pid" line, which tells it that nothing ran, and it runs the command itself.
        try:
            if os.stat(self.paths.socket).st_ino == self.inode:  # not a newer server's socket
                os.unlink(self.paths.socket)
        except OSError:
            pass
        self.listener.close()

    def accept(self, _listener: Any) -> None:
        conn, _ = self.listener.accept()
        conn.settimeout(5.0)  # a client that connects and says nothing must not stall the others
        try:
            request, fds = read_request(conn)
        except (OSError, ValueError) as exc:
            log(f"bad request: {exc}")
            conn.close()
            return
        pid = os.fork()
        if pid == 0:
            self.become_child(conn, request, fds)
        for fd in fds:
            os.close(fd)
        log(f"pid {pid}: {' '.join(request['argv'])}")
        try:
            conn.sendall(b"pid %d\n" % pid)
        except OSError:
            forward(pid, signal.SIGKILL)
        self.children[pid] = conn
        self.selector.register(conn, selectors.EVENT_READ, self.client_readable)

    def client_readable(self, conn: socket.socket) -> None:
        """A client only ever closes its end: its command must not outlive it."""
        try:
            data = conn.recv(64)
        except OSError:
            data = b""
        if data:
            return
        self.selector.unregister(conn)
        for pid, owner in self.children.items():
            if owner is conn:
                log(f"pid {pid}: client gone, killing its process group")
                forward(pid, signal.SIGKILL)

    def reap(self, _fd: Any) -> None:
        try:
            while os.read(self.wake_read, 512):
                pass
        except BlockingIOError:
            pass
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is not None:
                self.finish(conn, status)

    def finish(self, conn: socket.socket, status: int) -> None:
        try:
            self.selector.unregister(conn)
        except (KeyError, ValueError):
            pass  # already unregistered when its client went away
        try:
            conn.sendall(b"exit %d\n" % status)
        except OSError:
            pass
        conn.close()

    def become_child(self, conn: socket.socket, request: dict[str, Any], fds: list[int]) -> None:
        """Turn this fork into the CLI process the client would have been; never returns."""
        code = 70  # EX_SOFTWARE, if setting up the child itself fails
        try:
            os.setpgid(0, 0)  # its own group: the server can kill it with the local helpers it starts
            signal.set_wakeup_fd(-1)
            self.selector.close()
            for fd in (self.lock, self.wake_read, self.wake_write, self.listener.fileno(), conn.fileno(),
                       *(c.fileno() for c in self.children.values())):
                os.close(fd)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
                signal.signal(signum, signal.SIG_DFL)
            adopt(request, fds)
            code = run_cli(request["argv"])
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass
            os._exit(code)


def read_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 16, 3)
    if len(fds) != 3 or len(data) < HEADER.size:
        for fd in fds:
            os.close(fd)
        raise ValueError("expected a header and 3 descriptors")
    (length,) = HEADER.unpack_from(data)
    body = data[HEADER.size:]
    while len(body) < length:
        more = conn.recv(length - len(body))
        if not more:
            raise ValueError("request cut short")
        body += more
    return json.loads(body), list(fds)


def adopt(request: dict[str, Any], fds: list[int]) -> None:
    """The client's stdio, working folder, environment and umask become this process's."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    (in_enc, in_err), (out_enc, out_err), (err_enc, err_err) = request["encodings"]
    sys.stdin = open(0, encoding=in_enc, errors=in_err, closefd=False)
    line_buffered = 1 if os.isatty(1) else -1  # as python sets up stdout: by line only on a terminal
    sys.stdout = open(1, "w", buffering=line_buffered, encoding=out_enc, errors=out_err, closefd=False)
    sys.stderr = open(2, "w", buffering=1, encoding=err_enc, errors=err_err, closefd=False)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    time.tzset()
    os.umask(request["umask"])
    sys.argv = list(request["argv"])


def run_cli(argv: list[str]) -> int:
    from ddtree_deploy import cli

    try:
        cli.run(argv)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        sys.stderr.write(f"{exc.code}\n")
        return 1
    except BaseException:  # what the interpreter would print for an uncaught exception, and its exit code
        import traceback

        traceback.print_exc()
        return 1
    finally:
        atexit._run_exitfuncs()  # what the interpreter would run at exit (os._exit skips it)
    return 0


def log(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {message}", flush=True)

