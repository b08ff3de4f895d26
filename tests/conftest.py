"""Fixtures every test folder shares: an environment free of the user's settings, sandbox hosts, the CLI.

- `make_host(profile, root=None)`: a simulated host tree (sandbox/hosts.py) under the test's tmp_path.
- `cli(*args)`: runs `ddtree-deploy` in-process and returns a `CliOutcome` (exit code, stdout, stderr,
  and the parsed `--json` envelope).
Integration fixtures (real sshd) live in tests/integration/conftest.py.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ddtree_deploy.history import AUDIT_ENV
from sandbox.hosts import CACHE_ENV, SandboxHost, build_host

# A shell starts a background job (`bash scripts/test.sh &`) with SIGINT ignored, and an ignored signal
# is inherited through exec: every CLI the Ctrl-C tests start would ignore their SIGINT and hang. A
# handler is not inherited (the children start with SIGINT at its default), so set Python's own.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

#: The user's own home, cache folder and audit log, read before any test runs (the fixtures below move them).
USER_HOME = Path.home()
USER_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or USER_HOME / ".cache")
USER_AUDIT_LOG = Path(os.environ.get(AUDIT_ENV) or USER_HOME / ".local/state/ddtree-deploy/audit.jsonl")


def _point_state_at(mp: pytest.MonkeyPatch, home: Path) -> None:
    """HOME, the XDG state, config and runtime folders and the audit log into `home`.

    Whatever defaults to `~/.local/state/ddtree-deploy` (the audit log, a host's state), `~/.ssh` or
    `~/.config` then lands there. Caches stay shared (the release cache, pip's, the stand-in's
    compile cache): they hold nothing of the user's and save minutes.
    """
    mp.setenv("HOME", str(home))
    mp.setenv("XDG_CACHE_HOME", str(USER_CACHE))
    mp.setenv("XDG_STATE_HOME", str(home / ".local/state"))
    mp.setenv("XDG_CONFIG_HOME", str(home / ".config"))
    mp.setenv("XDG_RUNTIME_DIR", str(home / ".run"))
    mp.setenv(AUDIT_ENV, str(home / ".local/state/ddtree-deploy/audit.jsonl"))


@pytest.fixture(scope="session", autouse=True)
def _session_state(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The session's own HOME, for session and module fixtures (a test then gets one of its own)."""
    with pytest.MonkeyPatch.context() as mp:
        _point_state_at(mp, tmp_path_factory.mktemp("home"))
        yield


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory,
                  _session_state: None) -> None:
    """No test reads the user's inventory or DDTREE_DEPLOY_* settings, or writes the user's state (a
    HOME of its own: see `_point_state_at`)."""
    for name in list(os.environ):
        if name == "DDTREE_INVENTORY" or (name.startswith("DDTREE_DEPLOY_") and name != CACHE_ENV):
            monkeypatch.delenv(name)
    _point_state_at(monkeypatch, tmp_path_factory.mktemp("home"))


@pytest.fixture
def user_audit_log() -> Path:
    """Where the user's own audit log is (which no test may write)."""
    return USER_AUDIT_LOG


@pytest.fixture
def make_host(tmp_path: Path) -> Callable[..., SandboxHost]:
    """`make_host("ct129")` builds a host tree in tmp_path (about 1 s); `root=` puts it elsewhere."""
    def make(profile: str = "ct129", root: Path | None = None, **kwargs: Any) -> SandboxHost:
        return build_host(root or tmp_path / "hosts" / profile, profile, **kwargs)

    return make


@dataclass
class CliOutcome:
    exit_code: int
    stdout: str
    stderr: str

    @property
    def json(self) -> dict[str, Any]:
        """The `--json` envelope on stdout: `{"data": ...}` or `{"error": {...}}`."""
        value = json.loads(self.stdout)
        assert isinstance(value, dict) and set(value) in ({"data"}, {"error"}), self.stdout
        return value

    def rows(self) -> dict[str, dict[str, Any]]:
        """A fleet command's `--json` rows by host name (each with `result` or `error`)."""
        return {row["host"]: row for row in self.json["data"]["hosts"]}


@pytest.fixture
def cli() -> Callable[..., CliOutcome]:
    """`cli("status", "--json", inventory=path)`: the real app, in-process, through the same entry as the
    console script (`output.run_app`, where usage errors are rendered), stdout and stderr apart."""
    from ddtree_deploy.cli import app
    from ddtree_deploy.output import run_app

    def run(*args: str, inventory: Path | None = None) -> CliOutcome:
        argv = list(args) + (["--inventory", str(inventory)] if inventory is not None else [])
        with CliRunner().isolation() as (stdout, stderr, _):
            code = run_app(app, argv)
            sys.stdout.flush()
            sys.stderr.flush()
            return CliOutcome(exit_code=code, stdout=stdout.getvalue().decode(), stderr=stderr.getvalue().decode())

    return run
