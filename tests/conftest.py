"""Fixtures every test folder shares: an environment free of the user's settings, sandbox hosts, the CLI.

- `make_host(profile, root=None)`: a simulated host tree (sandbox/hosts.py) under the test's tmp_path.
- `cli(*args)`: runs `ddtree-deploy` in-process and returns a `CliOutcome` (exit code, stdout, stderr,
  and the parsed `--json` envelope).
Integration fixtures (real sshd) live in tests/integration/conftest.py.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from sandbox.hosts import CACHE_ENV, SandboxHost, build_host


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test reads the user's inventory or DDTREE_DEPLOY_* settings (the release cache location is kept)."""
    for name in list(os.environ):
        if name == "DDTREE_INVENTORY" or (name.startswith("DDTREE_DEPLOY_") and name != CACHE_ENV):
            monkeypatch.delenv(name)


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
    """`cli("status", "--json", inventory=path)`: the real Typer app, in-process, stdout and stderr apart."""
    from ddtree_deploy.cli import app

    def run(*args: str, inventory: Path | None = None) -> CliOutcome:
        argv = list(args) + (["--inventory", str(inventory)] if inventory is not None else [])
        result = CliRunner().invoke(app, argv, catch_exceptions=False)
        return CliOutcome(exit_code=result.exit_code, stdout=result.stdout, stderr=result.stderr)

    return run
