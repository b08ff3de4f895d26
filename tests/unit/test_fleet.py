"""Fan-out: every host gets a row in host order; waves stop once too many failed (counts or percentages)
and say why; forks bound the hosts at once; Ctrl-C is a flag, never an exception; bugs become rows."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

from ddtree_deploy.errors import ServiceError
from ddtree_deploy.fleet import Amount, FleetOptions, connecting, fan_out, interruptible
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


class Outcome(BaseModel):
    host: str
    outcome: str


def _outcomes(bad: set[str], started: list[str] | None = None) -> Callable[[Transport], Outcome]:
    """Work that returns (never raises) a "rolled_back" outcome on the hosts in `bad`, noting who started."""
    lock = threading.Lock()

    def work(t: Transport) -> Outcome:
        with lock:
            (started if started is not None else []).append(t.host.name)
        return Outcome(host=t.host.name, outcome="rolled_back" if t.host.name in bad else "ok")

    return work


def _rolled_back(result: Outcome) -> str | None:
    return "rolled back" if result.outcome == "rolled_back" else None


def test_a_canary_whose_result_counts_as_failed_stops_the_rollout_and_every_row_says_why(tmp_path: Path) -> None:
    inv = load_inventory(str(inventory(tmp_path, 3)))
    started: list[str] = []
    report = fan_out(inv, list(inv.hosts.values()), "test", _outcomes({"h0"}, started),
                     FleetOptions(wave_size=1, max_failures=0), failure=_rolled_back)
    assert started == ["h0"]
    rows = report.hosts
    assert rows[0].result is not None and not rows[0].skipped
    assert [row.skipped for row in rows] == [False, True, True]
    assert {row.skip_reason for row in rows[1:]} == {
        "not started: wave 1 exceeded --max-failures 0 (h0 rolled back)"}


def test_without_a_failure_predicate_returned_results_never_count(tmp_path: Path) -> None:
    inv = load_inventory(str(inventory(tmp_path, 2)))
    report = fan_out(inv, list(inv.hosts.values()), "test", _outcomes({"h0"}),
                     FleetOptions(wave_size=1, max_failures=0))
    assert not any(row.skipped for row in report.hosts)


@pytest.mark.parametrize(("hosts", "wave", "expected"), [
    (4, "50%", 2), (4, "10%", 1), (7, "25%", 1), (8, "25%", 2), (3, "100%", 3), (3, "0%", 1), (5, 0, 5), (5, 2, 2),
])
def test_a_wave_percentage_rounds_down_but_is_at_least_one_host_as_ansible_serial(
        hosts: int, wave: str | int, expected: int) -> None:
    assert FleetOptions(wave_size=wave).wave_length(hosts) == expected


def test_a_failure_percentage_stops_only_when_more_than_that_share_of_the_wave_failed(tmp_path: Path) -> None:
    inv = load_inventory(str(inventory(tmp_path, 6)))
    hosts = list(inv.hosts.values())
    started: list[str] = []
    # 34% of 6 is 2.04: waves of 2. One failure of two is 50%, not more than 50%, so the next wave starts
    report = fan_out(inv, hosts, "test", _outcomes({"h0", "h2", "h3"}, started),
                     FleetOptions(wave_size="34%", max_failures="50%"), failure=_rolled_back)
    assert sorted(started) == ["h0", "h1", "h2", "h3"]
    assert [row.host for row in report.hosts if row.skipped] == ["h4", "h5"]
    assert report.hosts[4].skip_reason == "not started: wave 2 exceeded --max-failures 50% (h2 rolled back, h3 rolled back)"


def test_a_failure_count_adds_up_over_the_waves(tmp_path: Path) -> None:
    inv = load_inventory(str(inventory(tmp_path, 4)))
    started: list[str] = []
    report = fan_out(inv, list(inv.hosts.values()), "test", _outcomes({"h0", "h1"}, started),
                     FleetOptions(wave_size=1, max_failures=1), failure=_rolled_back)
    assert started == ["h0", "h1"]
    assert report.hosts[2].skip_reason == "not started: wave 2 exceeded --max-failures 1 (h0 rolled back, h1 rolled back)"


@pytest.mark.parametrize("text", ["x", "-1", "150%", "2.5", "%", "", "²"])
def test_amounts_are_whole_host_counts_or_percentages(text: str) -> None:
    with pytest.raises(ValueError, match="percentage"):
        Amount.parse(text)
    with pytest.raises(ValidationError):
        FleetOptions(max_failures=text)
    assert str(Amount.parse("25%")) == "25%" and Amount.parse(" 3 ") == Amount(value=3)


def test_forks_bound_the_hosts_at_once_within_a_wave(tmp_path: Path) -> None:
    inv = load_inventory(str(inventory(tmp_path, 6)))
    lock, active, most = threading.Lock(), [0], [0]
    pair = threading.Barrier(2, timeout=10)  # two hosts do meet: the bound is reached, not just respected

    def work(t: Transport) -> Seen:
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
        pair.wait()
        with lock:
            active[0] -= 1
        return Seen(host=t.host.name)

    report = fan_out(inv, list(inv.hosts.values()), "test", work, FleetOptions(forks=2))
    assert len(report.succeeded) == 6 and most[0] == 2


def test_cancel_starts_no_further_host_or_wave_and_marks_the_report(tmp_path: Path) -> None:
    inv = load_inventory(str(inventory(tmp_path, 4)))
    cancel = threading.Event()
    started: list[str] = []

    def work(t: Transport) -> Seen:
        started.append(t.host.name)
        cancel.set()  # Ctrl-C while the first host runs
        return Seen(host=t.host.name)

    report = fan_out(inv, list(inv.hosts.values()), "test", work, FleetOptions(wave_size=2, forks=1), cancel=cancel)
    assert started == ["h0"] and report.interrupted
    assert [row.skip_reason for row in report.hosts] == ["", *["not started: interrupted (Ctrl-C)"] * 3]
    assert report.hosts[0].result is not None


def test_ctrl_c_in_the_block_sets_the_flag_and_raises_nothing_then_the_old_handler_is_back() -> None:
    heard: list[int] = []
    before = signal.getsignal(signal.SIGINT)
    with interruptible(heard.append) as cancel:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        assert cancel.wait(5)
    assert heard == [1, 2]
    assert signal.getsignal(signal.SIGINT) is before


def test_processes_the_hosts_start_never_take_sigint(tmp_path: Path) -> None:
    """A terminal's Ctrl-C reaches the whole process group: a local helper or an OpenSSH client must not die of it."""
    inv = load_inventory(str(inventory(tmp_path, 1)))
    probe = "import signal, sys; sys.exit(signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []))"

    def work(t: Transport) -> Seen:
        blocked = subprocess.run([sys.executable, "-c", probe], check=False).returncode == 1
        return Seen(host=str(blocked))

    report = fan_out(inv, list(inv.hosts.values()), "test", work)
    assert report.hosts[0].result == Seen(host="True")
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])  # this (main) thread still takes it
