"""`ddtree-deploy logs`: last lines as JSON or text, --follow printing what the server writes next."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import typer
import yaml
from typer.testing import CliRunner

from ddtree_deploy import service
from ddtree_deploy.commands.logs import logs

if TYPE_CHECKING:
    from tests.service.conftest import ServiceHost


def _inventory(host: ServiceHost, path: Path) -> Path:
    spec = host.spec().model_dump(mode="json")
    entry = {"transport": "local", "python": sys.executable, "package_root": str(host.package_root),
             "state_dir": str(host.root / "state"), "service": spec}
    path.write_text(yaml.safe_dump({"hosts": {"sbx": entry, "bare": {**entry, "service": None}}}))
    return path


def _run(*args: str) -> tuple[int, str, str]:
    app = typer.Typer()
    app.command()(logs)
    result = CliRunner().invoke(app, list(args), catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def test_last_lines_as_json_and_text(svc_host: ServiceHost, tmp_path: Path) -> None:
    inv = _inventory(svc_host, tmp_path / "inventory.yaml")
    assert service.restart(svc_host.transport(svc_host.spec())).ready
    code, out, err = _run("--host", "sbx", "-n", "2", "--json", "--inventory", str(inv))
    assert code == 0 and err == ""
    [row] = json.loads(out)["data"]["hosts"]
    assert row["host"] == "sbx" and row["result"]["text"].count("\n") == 2
    assert "fired up" in row["result"]["text"]
    code, out, _ = _run("--host", "sbx", "-n", "2", "--inventory", str(inv))
    assert code == 0 and out.splitlines() == row["result"]["text"].splitlines()


def test_a_host_without_service_fails_by_name(svc_host: ServiceHost, tmp_path: Path) -> None:
    inv = _inventory(svc_host, tmp_path / "inventory.yaml")
    code, out, _ = _run("--host", "bare", "--json", "--inventory", str(inv))
    assert code == 1
    [row] = json.loads(out)["data"]["hosts"]
    assert row["error"]["code"] == "no_service" and "bare" in row["error"]["message"]


def test_follow_with_json_is_bad_input(svc_host: ServiceHost, tmp_path: Path) -> None:
    inv = _inventory(svc_host, tmp_path / "inventory.yaml")
    code, out, err = _run("--host", "sbx", "--follow", "--json", "--inventory", str(inv))
    assert code == 2 and err == ""
    assert json.loads(out)["error"]["code"] == "invalid_input"


def test_follow_prints_new_lines_until_interrupted(svc_host: ServiceHost, tmp_path: Path) -> None:
    inv = _inventory(svc_host, tmp_path / "inventory.yaml")
    transport = svc_host.transport(svc_host.spec())
    assert service.restart(transport).ready
    code = ("import typer; from ddtree_deploy.commands.logs import logs; "
            "app = typer.Typer(); app.command()(logs); app()")
    follower = subprocess.Popen([sys.executable, "-c", code, "--host", "sbx", "-n", "1", "--follow",
                                 "--interval", "0.2", "--inventory", str(inv)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watchdog = threading.Timer(120, follower.kill)  # a hung follower fails the test instead of hanging it
    watchdog.start()
    try:
        assert follower.stdout is not None
        seen = [follower.stdout.readline()]  # printed once the last line was read: from here it polls
        for _ in range(3):
            assert service.status(transport).healthy  # each GET /health adds an access-log line
        while sum('"GET /health HTTP/1.1" 200' in line for line in seen) < 3 and seen[-1]:
            seen.append(follower.stdout.readline())
    finally:
        follower.send_signal(signal.SIGINT)
        rest, err = follower.communicate(timeout=30)
        watchdog.cancel()
    assert follower.returncode == 0, err
    out = "".join(seen) + rest
    assert '"GET /health_generate HTTP/1.1" 200' in seen[0]  # the last line: the readiness check's
    assert "fired up" not in out  # nothing older, then exactly what came after it
    assert out.count('"GET /health HTTP/1.1" 200') == 3
