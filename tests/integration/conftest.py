"""The SSH test fleet: real OpenSSH servers on 127.0.0.1, one per simulated host, with keys made per run.

`fleet` (session) builds the ct129 (cu130) and ct200 (cu128) host trees once and starts one
`sshd -D -e` per host on a free loopback port, with host keys and a client key generated for this run,
an ssh_config with the aliases, and a known_hosts holding both host keys. `inventory` (per test)
writes an inventory for it whose state directories are new, so tests never share host state;
`fresh_fleet` (per test) builds new host trees and servers for a test that changes installed files.
A server that cannot start FAILS the tests that need it; nothing here skips.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sshd_fleet import FLEET_PROFILES, Fleet, start_fleet

#: the session fleet's start-up timings (seconds), printed in the terminal summary
STARTUP: dict[str, float] = {}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """ct129 and ct200 behind real sshd, shared by the session: use it read-only (state goes in `inventory`)."""
    started = time.monotonic()
    fleet = start_fleet(tmp_path_factory.mktemp("fleet"))
    fleet.startup_s["total"] = time.monotonic() - started
    STARTUP.update(fleet.startup_s)
    yield fleet
    fleet.stop()


@pytest.fixture
def inventory(fleet: Fleet, tmp_path: Path) -> Path:
    """An inventory for the session fleet whose hosts keep their state under this test's tmp_path."""
    return fleet.write_inventory(tmp_path / "inventory.yaml", state_base=tmp_path / "state")


@pytest.fixture
def fleet_factory(tmp_path: Path) -> Iterator[Callable[..., Fleet]]:
    """`fleet_factory(profiles=(...), host_roots={...})`: fleets built where a test says, stopped after it."""
    started: list[Fleet] = []

    def make(profiles: tuple[str, ...] = FLEET_PROFILES, host_roots: dict[str, Path] | None = None) -> Fleet:
        fleet = start_fleet(tmp_path / f"fleet{len(started)}", profiles, host_roots)
        started.append(fleet)
        return fleet

    yield make
    for fleet in started:
        fleet.stop()


@pytest.fixture
def fresh_fleet(fleet_factory: Callable[..., Fleet]) -> Fleet:
    """New ct129 and ct200 trees and servers for this test alone (1 to 5 s a host with load): for tests that change files."""
    return fleet_factory()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Say how long the session fleet took to start, so a slow fixture is seen, not guessed."""
    if STARTUP:
        parts = ", ".join(f"{key} {seconds:.2f} s" for key, seconds in STARTUP.items())
        terminalreporter.write_line(f"sshd fleet start-up: {parts}")
