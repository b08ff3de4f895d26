"""The fork server: a warm server runs a command exactly as the CLI process would, and dies with its client.

Each test has its own private runtime folder (XDG_RUNTIME_DIR), so its server is its own; the
fixture kills it at the end. Commands run as real subprocesses of the real CLI.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from ddtree_deploy import forkserver
from ddtree_deploy.runtime import private_folder
from sandbox.hosts import SandboxHost

REPO = Path(__file__).resolve().parents[2]


class Runtime:
    """A private runtime folder and the environment that points the CLI at it."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.env = {**os.environ, "XDG_RUNTIME_DIR": str(folder), forkserver.IDLE_ENV: "60"}
        self.env.pop(forkserver.SWITCH, None)

    @property
    def server_folder(self) -> Path:
        return self.folder / "ddtree-deploy"

    def cli(self, *args: str, cwd: Path = REPO, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "ddtree_deploy.cli", *args], cwd=cwd, text=True,
                              capture_output=True, env={**self.env, **env}, timeout=120, check=False)

    def wait_for_server(self) -> int:
        """The serving pid, once its socket is up (the first command starts it as it exits)."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            serving = [line for line in self.log().splitlines() if "serving as pid" in line]
            if serving and list(self.server_folder.glob("*.sock")):
                return int(serving[-1].split()[-1])
            time.sleep(0.05)
        raise AssertionError(f"no fork server came up:\n{self.log()}")

    def log(self) -> str:
        return "".join(p.read_text() for p in self.server_folder.glob("*.log"))

    def children(self) -> list[int]:
        return [int(line.split()[2].rstrip(":")) for line in self.log().splitlines() if " pid " in line and ": " in line
                and "serving" not in line and "client gone" not in line]

    def stop_servers(self) -> None:
        for lock in self.server_folder.glob("*.lock"):
            text = lock.read_text().strip()
            if text:
                kill_quietly(int(text), signal.SIGKILL)


def kill_quietly(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead for our purposes
        return f.read().split(") ")[1][0] != "Z"


def wait_until(condition: object, what: str, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


@pytest.fixture
def runtime() -> Iterator[Runtime]:
    # Not tmp_path: a unix socket path must stay under 108 bytes.
    folder = Path(tempfile.mkdtemp(prefix="fs-"))
    rt = Runtime(folder)
    try:
        yield rt
    finally:
        rt.stop_servers()
        shutil.rmtree(folder, ignore_errors=True)


def test_a_warm_server_runs_the_command_with_the_clients_folder_environment_and_exit_code(
        runtime: Runtime, tmp_path: Path) -> None:
    work = tmp_path / "work"
    shutil.copytree(REPO / "overlays" / "ddtree" / "0.1.0", work / "mine" / "ddtree" / "0.1.0")
    first = runtime.cli("overlay", "list", "--json", cwd=work, DDTREE_OVERLAYS="mine")
    runtime.wait_for_server()
    served = runtime.cli("overlay", "list", "--json", cwd=work, DDTREE_OVERLAYS="mine")
    assert served.returncode == first.returncode == 0
    assert served.stdout == first.stdout and served.stderr == first.stderr == ""
    listed = json.loads(served.stdout)["data"]
    mine = [o["version"] for o in listed["overlays"] if o["origin"] == "$DDTREE_OVERLAYS"]
    assert mine == ["0.1.0"]  # the relative folder, from the client's cwd
    assert len(runtime.children()) == 1, runtime.log()  # the second run, and only it, was the server's

    bad = runtime.cli("push", "--host", "nowhere", "--inventory", str(tmp_path / "missing.yaml"), cwd=work)
    unserved = runtime.cli("push", "--host", "nowhere", "--inventory", str(tmp_path / "missing.yaml"), cwd=work,
                           **{forkserver.SWITCH: "0"})
    assert bad.returncode == unserved.returncode != 0
    assert bad.stderr == unserved.stderr and "missing.yaml" in bad.stderr and bad.stdout == unserved.stdout
    assert len(runtime.children()) == 2


def test_a_run_with_a_closed_stdin_is_not_served_and_still_works(runtime: Runtime) -> None:
    assert runtime.cli("overlay", "list", "--json").returncode == 0
    runtime.wait_for_server()
    closed = subprocess.run([sys.executable, "-m", "ddtree_deploy.cli", "overlay", "list", "--json"], cwd=REPO,
                            env=runtime.env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                            preexec_fn=lambda: os.close(0), timeout=120, check=False)
    assert closed.returncode == 0 and json.loads(closed.stdout)["data"]["overlays"]
    assert runtime.children() == []  # run in its own process: a closed descriptor cannot be passed


def test_a_server_starts_a_new_log_once_the_old_one_is_past_its_limit(runtime: Runtime) -> None:
    assert runtime.cli("overlay", "list", "--json").returncode == 0
    pid = runtime.wait_for_server()
    kill_quietly(pid, signal.SIGKILL)
    wait_until(lambda: not alive(pid), "the server did not die")
    (log,) = runtime.server_folder.glob("*.log")
    log.write_text("old line\n" * (forkserver.LOG_LIMIT // 9 + 1))
    assert runtime.cli("overlay", "list", "--json").returncode == 0  # the socket is dead: run here, start anew
    runtime.wait_for_server()
    assert log.stat().st_size < 1000 and "old line" not in log.read_text()


def test_a_command_waits_for_a_server_that_is_still_starting(runtime: Runtime) -> None:
    assert runtime.cli("overlay", "list", "--json").returncode == 0
    pid = runtime.wait_for_server()
    boot = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")  # to start the same one again
    kill_quietly(pid, signal.SIGKILL)
    wait_until(lambda: not alive(pid), "the server did not die")
    (lock,) = runtime.server_folder.glob("*.lock")
    lock.write_text("")
    for stale in runtime.server_folder.glob("*.sock"):
        stale.unlink()  # so that a socket seen below can only be the new server's
    (log,) = runtime.server_folder.glob("*.log")
    with log.open("ab") as logged:  # as start_server does: the server's lines are its log
        server = subprocess.Popen([b.decode() for b in boot], env=runtime.env, start_new_session=True,
                                  stdout=logged, stderr=logged)
    try:
        wait_until(lambda: lock.read_text().strip() == str(server.pid), "the new server took no lock")
        os.kill(server.pid, signal.SIGSTOP)  # it holds its lock and is importing: keep it there
        assert not list(runtime.server_folder.glob("*.sock"))
        client = subprocess.Popen([sys.executable, "-m", "ddtree_deploy.cli", "overlay", "list", "--json"], cwd=REPO,
                                  env=runtime.env, stdout=subprocess.PIPE, text=True)
        time.sleep(1.0)
        assert client.poll() is None  # waiting for the server, not importing and running the command itself
        os.kill(server.pid, signal.SIGCONT)
        out, _ = client.communicate(timeout=60)
        assert client.returncode == 0 and json.loads(out)["data"]["overlays"]
        assert len(runtime.children()) == 1, runtime.log()  # the new server ran it
    finally:
        kill_quietly(server.pid, signal.SIGKILL)
        server.wait()


def test_stale_code_or_another_search_path_gets_another_server(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a.py").write_text("x = 1\n")
    monkeypatch.setattr(forkserver, "PACKAGE_DIR", tmp_path)
    before = forkserver.server_key()
    assert forkserver.server_key() == before
    os.utime(tmp_path / "a.py", ns=(1, 1))
    edited = forkserver.server_key()
    assert edited != before
    monkeypatch.setattr(sys, "path", [*sys.path, str(tmp_path / "elsewhere")])
    assert forkserver.server_key() != edited


def test_a_runtime_folder_others_can_open_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert private_folder() == tmp_path / "ddtree-deploy"
    assert private_folder("ssh") == tmp_path / "ddtree-deploy" / "ssh"
    (tmp_path / "ddtree-deploy" / "ssh").chmod(0o755)
    assert private_folder("ssh") is None and private_folder() is not None
    (tmp_path / "ddtree-deploy").chmod(0o755)
    assert private_folder() is None
    assert forkserver.server_paths() is None


def test_only_one_server_starts_however_many_clients_ask(runtime: Runtime) -> None:
    procs = [subprocess.Popen([sys.executable, "-m", "ddtree_deploy.cli", "overlay", "list", "--json"], cwd=REPO,
                              env=runtime.env, stdout=subprocess.DEVNULL) for _ in range(3)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]
    runtime.wait_for_server()
    time.sleep(2)  # a second server, had one started, would be importing now
    assert runtime.log().count("serving as pid") == 1, runtime.log()


def test_an_idle_server_exits_and_removes_its_socket(runtime: Runtime) -> None:
    runtime.env[forkserver.IDLE_ENV] = "0.5"
    assert runtime.cli("overlay", "list", "--json").returncode == 0
    pid = runtime.wait_for_server()
    wait_until(lambda: not alive(pid), "the idle server never exited")
    assert not list(runtime.server_folder.glob("*.sock"))
    assert "idle: exiting" in runtime.log()


@pytest.fixture
def paused_push(runtime: Runtime, make_host: Callable[..., SandboxHost], tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    """A served `push` to a local host whose helper is paused mid-apply (its pid in the signal file)."""
    host = make_host("ct200")
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(yaml.safe_dump({"hosts": {"ct200": host.inventory_entry(transport="local")}}))
    runtime.env.update(DDTREE_INVENTORY=str(inventory), DDTREE_OVERLAYS=str(REPO / "overlays"))
    assert runtime.cli("overlay", "list", "--json").returncode == 0
    runtime.wait_for_server()
    signal_file = tmp_path / "paused"
    proc = subprocess.Popen([sys.executable, "-m", "ddtree_deploy.cli", "push", "--host", "ct200", "--overlay",
                             "ddtree@0.1.0", "--json"], cwd=REPO, text=True, stdout=subprocess.PIPE,
                            env={**runtime.env, "DDTREE_TEST_PAUSE_AT": "journal_written",
                                 "DDTREE_TEST_PAUSE_SIGNAL": str(signal_file)})
    wait_until(lambda: signal_file.exists() and signal_file.read_text(), "the push never paused", seconds=120)
    try:
        yield proc, signal_file
    finally:
        proc.kill()
        proc.wait()


def test_a_client_killed_by_sigkill_takes_its_command_and_helper_with_it(
        runtime: Runtime, paused_push: tuple[subprocess.Popen[str], Path]) -> None:
    proc, signal_file = paused_push
    helper = int(signal_file.read_text())
    (child,) = runtime.children()[-1:]
    assert alive(child) and alive(helper)
    proc.kill()
    proc.wait()
    wait_until(lambda: not alive(child) and not alive(helper), "the command outlived its killed client")
    status = json.loads(runtime.cli("status", "--json").stdout)["data"]["hosts"][0]["result"]
    assert status["journal_open"] is True  # as after any killed controller; rollback undoes it (tests/push)


def test_a_signal_to_the_client_reaches_the_command(runtime: Runtime,
                                                    paused_push: tuple[subprocess.Popen[str], Path]) -> None:
    proc, signal_file = paused_push
    helper = int(signal_file.read_text())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == -signal.SIGTERM  # the client ends as the command did
    wait_until(lambda: not alive(helper), "SIGTERM never reached the command's process group")


def state_of(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[1][0]


def test_ctrl_z_stops_the_command_with_its_client_and_fg_resumes_both(
        runtime: Runtime, paused_push: tuple[subprocess.Popen[str], Path]) -> None:
    proc, signal_file = paused_push
    helper = int(signal_file.read_text())
    (child,) = runtime.children()[-1:]
    proc.send_signal(signal.SIGTSTP)  # what the terminal sends the foreground job on Ctrl-Z
    wait_until(lambda: state_of(proc.pid) == "T", "the client did not stop")
    wait_until(lambda: state_of(child) == "T" and state_of(helper) == "T", "the command ran on behind a stopped client")
    proc.send_signal(signal.SIGCONT)  # the shell's fg
    wait_until(lambda: "T" not in (state_of(proc.pid), state_of(child), state_of(helper)), "fg resumed only the client")
    assert proc.poll() is None  # still the same push, paused in its helper as before

