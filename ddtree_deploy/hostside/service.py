"""Host side of the server's lifecycle: start, stop, fail-fast readiness wait, status, logs, loopback HTTP.

A `process` service runs detached in its own session (so its process group id is its pid), with
its log and a record (`server.json`: pid, pgid, argv, start time) under `<state_dir>/server/`.
Stop signals the whole group, because SGLang forks scheduler and detokenizer processes that keep
GPU memory until they exit. A `systemd` service is driven through systemctl and journalctl.
The readiness wait runs here, on the host, so noticing a dead server costs one poll interval,
not a controller round trip. Every op takes `spec`: the inventory's service block as a dict.
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from typing import Any, Dict, List, Optional, Set, Tuple

from .common import Context, HelperFailure, append_history, read_json, write_json
from .locks import require_lock

RECORD = "server.json"
LOG = "server.log"
TAIL_LINES = 40
MAX_READ = 1 << 20  # bytes per incremental log read or HTTP body
ACCEPT_POLL_S = 0.02  # how often a readiness wait tries a closed port between its polls
LIVE_STATES = ("active", "activating", "reloading")


# ---------------------------------------------------------------- /proc readers (Linux)

def _stat(pid: int) -> Optional[Tuple[str, int, int, int]]:
    """(state, pgrp, session, starttime) of a pid, or None if it is gone."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            raw = f.read().decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = raw[raw.rindex(")") + 2:].split()  # the command name may hold spaces and parentheses
    return fields[0], int(fields[2]), int(fields[3]), int(fields[19])


def _pids() -> List[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _live(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] not in "ZX"  # a zombie is dead: nobody may be left to reap it


def _group(pgid: int) -> List[int]:
    """Live processes of a process group."""
    found = []
    for pid in _pids():
        st = _stat(pid)
        if st is not None and st[1] == pgid and st[0] not in "ZX":
            found.append(pid)
    return found


def _cmdline(pid: int) -> str:
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:300]
    except OSError:
        return "?"


def _listening_inodes(port: int) -> Set[str]:
    """Socket inodes listening on `port`, on any address, IPv4 or IPv6."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for row in rows:
            cols = row.split()
            if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(cols[9])
    return inodes


_OWNERS: Dict[str, Dict[str, Any]] = {}  # socket inode -> owner, so a wait loop scans /proc/*/fd once


def _port_owners(port: int) -> List[Dict[str, Any]]:
    """Who listens on `port`: pid, pgid and command; pid None where /proc hides the owner from us."""
    inodes = _listening_inodes(port)
    wanted = {"socket:[%s]" % inode: inode for inode in inodes
              if inode not in _OWNERS or not _live(_OWNERS[inode]["pid"])}
    for pid in _pids() if wanted else []:
        try:
            fds = os.listdir("/proc/%d/fd" % pid)
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink("/proc/%d/fd/%s" % (pid, fd))
            except OSError:
                continue
            if target in wanted:  # one process may listen twice (IPv4 and IPv6): keep scanning its fds
                st = _stat(pid)
                _OWNERS[wanted.pop(target)] = {"pid": pid, "pgid": st[1] if st else None, "command": _cmdline(pid)}
        if not wanted:
            break
    owners: List[Dict[str, Any]] = []
    for inode in sorted(inodes):
        owner = _OWNERS.get(inode) or {"pid": None, "pgid": None, "command": "?"}
        if owner["pid"] is None or owner not in owners:  # a dual-stack listener is one owner
            owners.append(owner)
    return owners


def _describe(owners: List[Dict[str, Any]]) -> str:
    return ", ".join("pid %s (%s)" % (o["pid"], o["command"]) if o["pid"] else "a process this user cannot see"
                     for o in owners)


# ---------------------------------------------------------------- loopback HTTP

@functools.lru_cache(maxsize=1)
def _opener() -> Any:
    """urllib's opener without proxies (loopback never goes through one), built on first use: importing
    urllib costs ~20 ms that a helper which never sends a request should not pay at every start."""
    import urllib.request

    return urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_request(port: int, path: str, method: str = "GET", body: Any = None,
                 timeout: float = 30.0) -> Dict[str, Any]:
    """One request to 127.0.0.1:port; HTTP errors are answers, a refused connection is `error`."""
    import urllib.error
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request("http://127.0.0.1:%d%s" % (port, path), data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    started = time.monotonic()
    try:
        with _opener().open(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read(MAX_READ)
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read(MAX_READ)
    except (OSError, ValueError) as exc:  # refused, reset, timeout, malformed answer
        return {"status": None, "body": "", "error": str(getattr(exc, "reason", exc)),
                "elapsed_s": time.monotonic() - started}
    return {"status": status, "body": raw.decode(errors="replace"), "error": None,
            "elapsed_s": time.monotonic() - started}


def accepting(port: int) -> bool:
    """Whether something accepts connections on the loopback port (a connect, closed at once: ~50 us)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.05):
            return True
    except OSError:
        return False


class _ReadyChecker:
    """GETs the ready path in a background thread, so a hanging request never delays noticing a death."""

    def __init__(self, port: int, path: str, timeout: float) -> None:
        self.port, self.path, self.timeout = port, path, timeout
        self.last: Dict[str, Any] = {"status": None, "error": "not asked yet"}
        self._thread: Optional[threading.Thread] = None

    def poll(self) -> bool:
        """True once a GET answered 200; starts the next GET when none is in flight."""
        if self.last.get("status") == 200:
            return True
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._ask, daemon=True)
            self._thread.start()
        return False

    def wait(self, seconds: float) -> None:
        """Sleep `seconds`, but wake as soon as the GET in flight answers 200, or as soon as the port,
        closed at the last GET, starts accepting (then the next GET goes now, not a poll interval later)."""
        deadline = time.monotonic() + seconds
        if self._thread is not None:
            self._thread.join(seconds)
        closed = self.last.get("status") is None and not accepting(self.port)
        while self.last.get("status") != 200:
            left = deadline - time.monotonic()
            if left <= 0 or (closed and accepting(self.port)):
                return
            time.sleep(min(left, ACCEPT_POLL_S) if closed else left)

    def _ask(self) -> None:
        self.last = http_request(self.port, self.path, timeout=self.timeout)


# ---------------------------------------------------------------- backends

class _Backend:
    """What the generic ops need from a kind of service."""

    def __init__(self, ctx: Context, spec: Dict[str, Any]) -> None:
        self.ctx, self.spec = ctx, spec

    @property
    def port(self) -> int:
        return int(self.spec["port"])

    def running(self) -> bool:
        raise NotImplementedError

    def owns(self, pid: int) -> bool:
        raise NotImplementedError

    def read_log(self, offset: Any) -> Tuple[str, Any]:
        """New log text since `offset`, and the offset to read from next."""
        raise NotImplementedError

    def tail(self, count: int) -> Tuple[List[str], Any]:
        """The last `count` log lines, and the offset of the log's end."""
        raise NotImplementedError

    def has_started(self) -> bool:
        """Whether there is a server to wait for at all."""
        return True

    def start(self, argv: List[str], env: Dict[str, str]) -> Dict[str, Any]:
        raise NotImplementedError

    def stop(self, grace_s: float) -> Dict[str, Any]:
        """Stop and confirm; {was_running, pids, sigkill, waited_s}."""
        raise NotImplementedError

    def describe(self) -> Dict[str, Any]:
        raise NotImplementedError


class _Process(_Backend):
    """A process group the helper started; `server.json` says which."""

    def __init__(self, ctx: Context, spec: Dict[str, Any]) -> None:
        super().__init__(ctx, spec)
        self.log_path = ctx.path("server", LOG)
        self.record = read_json(ctx.path("server", RECORD)) or {}

    @property
    def port(self) -> int:
        return int(self.record.get("port") or self.spec["port"])

    def _pgid(self) -> Optional[int]:
        """Our group id, or None when the recorded group is gone or its id now belongs to someone else."""
        pgid = self.record.get("pgid")
        if not pgid or pgid <= 1 or pgid == os.getpgrp():
            return None
        leader = _stat(pgid)
        if leader is not None and leader[3] != self.record.get("starttime"):
            return None  # pid reused by an unrelated process
        return int(pgid)

    def members(self) -> List[int]:
        pgid = self._pgid()
        return _group(pgid) if pgid else []

    def running(self) -> bool:
        """The group leader (the server's main process) is alive."""
        pgid = self._pgid()
        return pgid is not None and _live(pgid)

    def owns(self, pid: int) -> bool:
        st = _stat(pid)
        return st is not None and st[1] == self._pgid()

    def read_log(self, offset: Any) -> Tuple[str, Any]:
        try:
            with open(self.log_path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                start = 0 if int(offset or 0) > size else int(offset or 0)  # shrunk: a new log began
                f.seek(start)
                raw = f.read(MAX_READ)
        except FileNotFoundError:
            return "", 0
        return raw.decode(errors="replace"), start + len(raw)

    def tail(self, count: int) -> Tuple[List[str], Any]:
        try:
            with open(self.log_path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                f.seek(max(0, size - 256 * 1024))
                raw = f.read(size)
        except FileNotFoundError:
            return [], 0
        return (raw.decode(errors="replace").splitlines()[-count:] if count > 0 else []), size

    def has_started(self) -> bool:
        return bool(self.record)

    def describe(self) -> Dict[str, Any]:
        members = self.members()
        return {"kind": "process", "running": self.running(), "pid": self.record.get("pid"),
                "pgid": self.record.get("pgid"), "pids": members, "argv": self.record.get("argv"),
                "started": self.record.get("started"), "stopped": self.record.get("stopped"),
                "log": self.log_path}

    def start(self, argv: List[str], env: Dict[str, str]) -> Dict[str, Any]:
        if self.running():
            raise HelperFailure("already_running", "server already runs as pid %s: %s"
                                % (self.record.get("pid"), " ".join(self.record.get("argv") or [])),
                                "stop it first (ddtree-deploy restart stops, then starts)", pid=self.record.get("pid"))
        owners = _port_owners(self.port)
        if owners:
            raise HelperFailure("port_taken", "port %d is already in use by %s" % (self.port, _describe(owners)),
                                "stop that process or give the service another port", owners=owners)
        if os.path.exists(self.log_path):
            os.replace(self.log_path, self.log_path + ".1")  # keep the previous run's log for a post-mortem
        cwd = self.spec.get("cwd") or self.ctx.state_dir
        with open(self.log_path, "ab") as log:
            try:
                proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                        cwd=cwd, env=dict(os.environ, **env), start_new_session=True)
            except OSError as exc:
                raise HelperFailure("spawn_failed", "cannot start %s: %s" % (argv[0], exc.strerror),
                                    "fix the service's command in the inventory", argv=argv) from None
        st = _stat(proc.pid)
        self.record = {"pid": proc.pid, "pgid": proc.pid, "starttime": st[3] if st else None, "argv": argv,
                       "env": sorted(env), "cwd": cwd, "port": self.port, "started": time.time(), "log": self.log_path}
        write_json(self.ctx.path("server", RECORD), self.record)
        append_history(self.ctx, {"op": "service_start", "pid": proc.pid, "argv": argv})
        return dict(self.record, log_offset=0)

    def stop(self, grace_s: float) -> Dict[str, Any]:
        pgid = self._pgid()
        members = _group(pgid) if pgid is not None else []
        started = time.monotonic()
        escalated = False
        if pgid is not None and members:
            escalated = not _signal_until_gone(pgid, signal.SIGTERM, grace_s)
            if escalated and not _signal_until_gone(pgid, signal.SIGKILL, 5.0):
                left = _group(pgid)
                raise HelperFailure("stop_failed", "processes %s of group %s survived SIGKILL" % (left, pgid),
                                    "look at them with ps; they may be stuck in the kernel (D state)", pids=left)
        if self.record and not self.record.get("stopped"):
            self.record["stopped"] = time.time()
            write_json(self.ctx.path("server", RECORD), self.record)
            append_history(self.ctx, {"op": "service_stop", "pids": members, "sigkill": escalated})
        return {"was_running": bool(members), "pids": members, "sigkill": escalated,
                "waited_s": time.monotonic() - started}


def _signal_until_gone(pgid: int, sig: int, within_s: float) -> bool:
    """Signal the group, then poll /proc until no member is left; True if it emptied in time."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return True
    deadline = time.monotonic() + within_s
    while _group(pgid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


class _Systemd(_Backend):
    """A systemd unit; its journal is the log, and a journal cursor (or `@epoch`) is the offset."""

    @property
    def unit(self) -> str:
        return str(self.spec["unit"])

    def _run(self, argv: List[str]) -> str:
        try:
            proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=60, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise HelperFailure("systemd_failed", "%s: %s" % (" ".join(argv), exc),
                                "is systemd running on this host?") from None
        if proc.returncode != 0:
            raise HelperFailure("systemd_failed", "%s exited %d: %s" % (" ".join(argv), proc.returncode,
                                proc.stderr.decode(errors="replace").strip()[-500:]),
                                "check the unit with systemctl status %s" % self.unit)
        return proc.stdout.decode(errors="replace")

    def _show(self) -> Dict[str, str]:
        out = self._run(["systemctl", "show", self.unit, "-p", "ActiveState", "-p", "MainPID"])
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def running(self) -> bool:
        return self._show().get("ActiveState") in LIVE_STATES

    def owns(self, pid: int) -> bool:
        """In the unit's cgroup, or in its main process's session (systemd starts services with setsid)."""
        try:
            with open("/proc/%d/cgroup" % pid) as f:
                if ("/" + self.unit) in f.read():
                    return True
        except OSError:
            pass
        main_pid, st = self.describe()["pid"], _stat(pid)
        main = _stat(main_pid) if main_pid else None
        return st is not None and main is not None and st[2] == main[2]

    def read_log(self, offset: Any) -> Tuple[str, Any]:
        where = ["--since", str(offset)] if str(offset).startswith("@") else ["--after-cursor", str(offset)]
        out = self._run(["journalctl", "-u", self.unit, "-o", "cat", "--no-pager", "--show-cursor"] + where)
        text, _, cursor = out.rpartition("-- cursor: ")
        return (text, cursor.strip()) if cursor.strip() else (out, offset)

    def tail(self, count: int) -> Tuple[List[str], Any]:
        out = self._run(["journalctl", "-u", self.unit, "-o", "cat", "--no-pager", "--show-cursor",
                         "-n", str(count)])
        text, _, cursor = out.rpartition("-- cursor: ")
        return (text.splitlines()[-count:] if count > 0 else []), cursor.strip() or "@%d" % int(time.time())

    def describe(self) -> Dict[str, Any]:
        shown = self._show()
        return {"kind": "systemd", "unit": self.unit, "running": shown.get("ActiveState") in LIVE_STATES,
                "active_state": shown.get("ActiveState"), "pid": int(shown.get("MainPID") or 0) or None}

    def start(self, argv: List[str], env: Dict[str, str]) -> Dict[str, Any]:
        since = "@%d" % int(time.time())
        self._run(["systemctl", "start", self.unit])
        append_history(self.ctx, {"op": "service_start", "unit": self.unit})
        return {"unit": self.unit, "argv": argv, "started": time.time(), "log_offset": since,
                "pid": self.describe()["pid"]}

    def stop(self, grace_s: float) -> Dict[str, Any]:
        was = self.running()
        started = time.monotonic()
        self._run(["systemctl", "stop", self.unit])  # the unit's own TimeoutStopSec governs escalation
        append_history(self.ctx, {"op": "service_stop", "unit": self.unit})
        return {"was_running": was, "pids": [], "sigkill": False, "waited_s": time.monotonic() - started}


def _backend(ctx: Context, args: Dict[str, Any]) -> _Backend:
    spec = args.get("spec")
    if not isinstance(spec, dict) or "port" not in spec:
        raise HelperFailure("bad_request", "service ops need the service spec", "controller bug: pass args.spec")
    ctx.ensure_state_dir()  # starts and stops go to the host's history, even on a host never pushed to
    return _Systemd(ctx, spec) if spec.get("kind") == "systemd" else _Process(ctx, spec)


# ---------------------------------------------------------------- ops

def service_start(ctx: Context, args: Dict[str, Any]) -> Dict[str, Any]:
    """Start the server with argv `args` (the full argv) and extra `env`; refuse if it runs or the port is taken,
    or if the caller does not hold the host lock (two controllers must never start one server twice)."""
    require_lock(ctx, "service_start")
    backend = _backend(ctx, args)
    # unbuffered by default: a python server's fatal lines must reach the log while we watch it
    env = {"PYTHONUNBUFFERED": "1"}
    env.update(backend.spec.get("env") or {})
    env.update(args.get("env") or {})
    return backend.start([str(word) for word in args["args"]], {k: str(v) for k, v in env.items()})


def service_stop(ctx: Context, args: Dict[str, Any]) -> Dict[str, Any]:
    """Stop the server (the whole group: SIGTERM, `grace_s`, SIGKILL) and report whether the port is free; only
    for the holder of the host lock (a stop under another controller's push would break its restart)."""
    require_lock(ctx, "service_stop")
    backend = _backend(ctx, args)
    grace = float(args.get("grace_s", backend.spec.get("stop_grace_s", 30.0)))
    report = backend.stop(grace)
    deadline = time.monotonic() + 2.0  # a dead listener's socket closes with it; allow the kernel a moment
    owners = _port_owners(backend.port)
    while owners and time.monotonic() < deadline:
        time.sleep(0.05)
        owners = _port_owners(backend.port)
    report.update(port=backend.port, port_free=not owners, port_owners=owners)
    return report


class _LogScanner:
    """Reads the log incrementally from an offset and matches whole lines against fatal patterns."""

    def __init__(self, backend: _Backend, offset: Any, patterns: List[str]) -> None:
        self.backend, self.offset = backend, offset
        self.patterns = [re.compile(p) for p in patterns]
        self.partial = ""

    def scan(self, final: bool = False) -> Optional[Dict[str, str]]:
        text, self.offset = self.backend.read_log(self.offset)
        lines = (self.partial + text).split("\n")
        self.partial = "" if final else lines.pop()
        for line in lines:
            for pattern in self.patterns:
                if pattern.search(line):
                    return {"pattern": pattern.pattern, "line": line[:500]}
        return None


def service_wait(ctx: Context, args: Dict[str, Any]) -> Dict[str, Any]:
    """Wait for readiness; stop at once on exit, a fatal log line, or a foreign process on the port.

    Answers {ready, reason, waited_s, log_tail, ...}; reason is one of ready, exited, fatal_log,
    port_taken, timeout, not_running.
    """
    backend = _backend(ctx, args)
    spec = backend.spec
    port = int(args.get("port") or backend.port)
    poll = min(0.5, max(0.05, float(args.get("poll_s", spec.get("poll_interval_s", 0.25)))))
    timeout = float(args.get("timeout_s", spec.get("ready_timeout_s", 600.0)))
    patterns = args.get("fatal_patterns", spec.get("fatal_patterns") or [])
    scanner = _LogScanner(backend, args.get("since_offset", 0), patterns)
    checker = _ReadyChecker(port, args.get("ready_path", spec.get("ready_path", "/health_generate")),
                            float(args.get("request_timeout_s", 10.0)))
    started = time.monotonic()
    extra: Dict[str, Any] = {}
    while True:
        matched = scanner.scan()
        if matched:
            reason, extra = "fatal_log", {"matched": matched}
            break
        if not backend.running():
            reason = "exited" if backend.has_started() else "not_running"
            extra = {"matched": scanner.scan(final=True)}
            break
        foreign = [o for o in _port_owners(port) if o["pid"] and not backend.owns(o["pid"])]
        if foreign:
            reason, extra = "port_taken", {"port_owners": foreign}
            break
        if checker.poll():
            reason = "ready"
            break
        if time.monotonic() - started >= timeout:
            reason = "timeout"
            break
        checker.wait(poll)
    identity = {k: v for k, v in backend.describe().items() if k in ("pid", "argv", "unit") and v is not None}
    return dict(extra, ready=reason == "ready", reason=reason, waited_s=time.monotonic() - started,
                log_tail=backend.tail(TAIL_LINES)[0], log_offset=scanner.offset, last_http=checker.last,
                port=port, **identity)


def service_status(ctx: Context, args: Dict[str, Any]) -> Dict[str, Any]:
    """Is the server alive, is its port listening (and by whom), and what does a health GET answer."""
    backend = _backend(ctx, args)
    port = backend.port
    owners = _port_owners(port)
    health = http_request(port, args.get("path", "/health"), timeout=float(args.get("timeout", 5.0))) \
        if owners else {"status": None, "body": "", "error": "port not listening"}
    return dict(backend.describe(), port=port, listening=bool(owners), port_owners=owners,
                health={"status": health["status"], "error": health["error"]})


def service_logs(ctx: Context, args: Dict[str, Any]) -> Dict[str, Any]:
    """The last `n` lines (offset omitted), or what was written since `offset` (for --follow)."""
    backend = _backend(ctx, args)
    if args.get("offset") is None:
        lines, end = backend.tail(int(args.get("n", TAIL_LINES)))
        return {"text": "".join(line + "\n" for line in lines), "offset": end}
    text, offset = backend.read_log(args["offset"])
    return {"text": text, "offset": offset}


def http(ctx: Context, args: Dict[str, Any]) -> Dict[str, Any]:
    """One HTTP request to the host's loopback: {method, path, port, body, timeout}."""
    return http_request(int(args["port"]), str(args.get("path", "/")), str(args.get("method", "GET")),
                        args.get("body"), float(args.get("timeout", 30.0)))


OPS = {"service_start": service_start, "service_stop": service_stop, "service_wait": service_wait,
       "service_status": service_status, "service_logs": service_logs, "http": http}
