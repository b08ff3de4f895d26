"""Fan-out: every host gets a row in host order; waves stop once too many failed; bugs become rows."""

from __future__ import annotations

import threading
from pathlib import Path

from pydantic import BaseModel

from ddtree_deploy.errors import ServiceError
from ddtree_deploy.fleet import FleetOptions, connecting, fan_out
from ddtree_deploy.inventory import load_inventory
from ddtree_deploy.transport import Transport


class Seen(BaseModel):
    host: str


def inventory(tmp_path: Path, count: int) -> Path:
    path = tmp_path / "inventory.yaml"
    hosts = "".join(f"  h{i}: {{transport: local, python: python3}}\n" for i in range(count))
    path.write_text(f"hosts:\n{hosts}")
    return path


def test_rows_come_back_in_host_order_with_errors_as_rows(tmp_path: Path) -> None:
    inv = load_inventory(str(inventory(tmp_path, 4)))

    def work(t: Transport) -> Seen:
        if t.host.name == "h1":
            raise ServiceError("server exited", code="server_exited")
        if t.host.name == "h2":
            raise RuntimeError("a bug")
        return Seen(host=t.host.name)

    report = fan_out(inv, list(inv.hosts.values()), "test", work)
    assert [row.host for row in report.hosts] == ["h0", "h1", "h2", "h3"]
    assert [row.host for row in report.succeeded] == ["h0", "h3"]
    errors = {row.host: row.error for row in report.failed}
    assert errors["h1"] is not None and errors["h1"].code == "server_exited" and errors["h1"].message.startswith("h1")
    assert errors["h2"] is not None and errors["h2"].code == "internal_error" and "a bug" in errors["h2"].message


def test_waves_stop_after_max_failures(tmp_path: Path) -> None:
    inv = load_inventory(str(inventory(tmp_path, 5)))
    started: list[str] = []
    lock = threading.Lock()

    def work(t: Transport) -> Seen:
        with lock:
            started.append(t.host.name)
        raise ServiceError("canary failed", code="server_exited")

    report = fan_out(inv, list(inv.hosts.values()), "test", work, FleetOptions(wave_size=1, max_failures=1))
    assert started == ["h0", "h1"]  # the canary, one more, then no further wave
    assert [row.skipped for row in report.hosts] == [False, False, True, True, True]


def test_connecting_starts_the_first_wave_and_fan_out_takes_those_transports(tmp_path: Path) -> None:
    inv = load_inventory(str(inventory(tmp_path, 3)))
    hosts = list(inv.hosts.values())
    options = FleetOptions(wave_size=2)
    used: dict[str, Transport] = {}

    def work(t: Transport) -> Seen:
        used[t.host.name] = t
        return Seen(host=t.host.name)

    with connecting(inv, hosts, "test", options) as started:
        early = dict(started)
        assert sorted(early) == ["h0", "h1"]  # the first wave only
        report = fan_out(inv, hosts, "test", work, options, started)
        assert started == {}  # fan_out took them over (and closed them)
    assert [row.host for row in report.succeeded] == ["h0", "h1", "h2"]
    assert used["h0"] is early["h0"] and used["h1"] is early["h1"]
    assert used["h2"] not in early.values()


def test_a_start_that_failed_in_the_background_is_the_first_ops_error(tmp_path: Path) -> None:
    path = tmp_path / "inventory.yaml"
    path.write_text(f"hosts:\n  h0: {{transport: local, python: {tmp_path / 'no-such-python'}}}\n")
    inv = load_inventory(str(path))
    hosts = list(inv.hosts.values())

    def work(t: Transport) -> Seen:
        t.call("state")
        return Seen(host=t.host.name)

    with connecting(inv, hosts, "test") as started:
        report = fan_out(inv, hosts, "test", work, started=started)
    error = report.hosts[0].error
    assert error is not None and error.code == "python_not_found" and "no-such-python" in error.message
