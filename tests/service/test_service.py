"""Service control through LocalTransport: start, fail-fast waits, stop of the whole group, port and logs."""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from ddtree_deploy import service
from ddtree_deploy.errors import ServiceError

if TYPE_CHECKING:
    from tests.service.conftest import ServiceHost


def test_restart_comes_up_ready_with_overlay_args(svc_host: ServiceHost) -> None:
    transport = svc_host.transport(svc_host.spec())
    report = service.restart(transport, ["--speculative-algorithm", "DDTREE"])
    assert report.ready, report
    assert report.reason == "ready"
    assert report.argv[-2:] == ["--speculative-algorithm", "DDTREE"]
    assert report.argv[:2] == [sys.executable, str(svc_host.spec().command[1])]
    assert report.pid is not None
    assert report.stop is not None and not report.stop.was_running
    state = service.status(transport)
    assert state.healthy and state.pid == report.pid and state.argv == report.argv
    assert [o.pid for o in state.port_owners] == [report.pid]
    report.raise_for_failure()  # ready: nothing raised


def test_broken_package_is_reported_with_its_traceback(svc_host: ServiceHost) -> None:
    broken = svc_host.package_root / "sglang" / "srt" / "speculative" / "ddtree_utils.py"
    broken.write_text("def build_tree(:\n")
    transport = svc_host.transport(svc_host.spec(ready_timeout_s=120))
    report = service.restart(transport)
    assert not report.ready
    assert report.reason in ("exited", "fatal_log")
    assert report.waited_s < 120  # a dead server is never waited out
    tail = "\n".join(report.log_tail)
    assert "Traceback (most recent call last):" in tail
    assert "SyntaxError" in tail and "ddtree_utils.py" in tail
    with pytest.raises(ServiceError) as err:
        report.raise_for_failure()
    assert err.value.code == f"server_{report.reason}" and err.value.host == "sbx"


def test_crash_after_start_stops_the_wait(svc_host: ServiceHost) -> None:
    spec = svc_host.spec(["--standin-start-delay", "30", "--standin-crash-after", "0.5"], ready_timeout_s=120)
    report = service.restart(svc_host.transport(spec))
    assert not report.ready and report.reason in ("exited", "fatal_log")
    assert report.waited_s < 30
    assert any("stand-in crash requested" in line for line in report.log_tail)


def test_exit_without_fatal_line_is_reason_exited(svc_host: ServiceHost) -> None:
    spec = svc_host.spec(command=[sys.executable, "-c", "print('loading weights'); raise SystemExit(3)"],
                         ready_timeout_s=120)
    report = service.restart(svc_host.transport(spec))
    assert report.reason == "exited" and report.matched is None
    assert "loading weights" in report.log_tail


def test_fatal_log_line_of_a_live_process(svc_host: ServiceHost) -> None:
    code = "import time; print('RuntimeError: CUDA error: an illegal memory access', flush=True); time.sleep(60)"
    spec = svc_host.spec(command=[sys.executable, "-c", code], ready_timeout_s=120)
    transport = svc_host.transport(spec)
    report = service.restart(transport)
    assert report.reason == "fatal_log"
    assert report.matched is not None and report.matched.pattern == "CUDA error"
    assert "illegal memory access" in report.matched.line
    assert service.status(transport).running  # the process lives on: reporting is not stopping


def test_fatal_patterns_are_configurable(svc_host: ServiceHost) -> None:
    code = "import time; print('NCCL WARN peer vanished', flush=True); time.sleep(60)"
    spec = svc_host.spec(command=[sys.executable, "-c", code], fatal_patterns=[r"NCCL WARN"], ready_timeout_s=3)
    report = service.restart(svc_host.transport(spec))
    assert report.reason == "fatal_log" and report.matched is not None
    assert report.matched.pattern == "NCCL WARN"


def test_never_ready_times_out_with_last_answer(svc_host: ServiceHost) -> None:
    spec = svc_host.spec(["--standin-hang-unready"], ready_timeout_s=1.5)
    report = service.restart(svc_host.transport(spec))
    assert not report.ready and report.reason == "timeout"
    assert report.waited_s >= 1.5
    assert report.last_http is not None and report.last_http["status"] == 503
    assert "503" in report.message


def test_stop_kills_the_whole_group(svc_host: ServiceHost, group_members: Callable[[int], list[int]]) -> None:
    transport = svc_host.transport(svc_host.spec(["--fork-children", "2"]))
    report = service.restart(transport)
    assert report.ready and report.pid is not None
    before = group_members(report.pid)
    assert len(before) == 3  # server + 2 children, like SGLang's scheduler and detokenizer
    stopped = service.stop(transport, grace_s=10)
    assert stopped.was_running and sorted(stopped.pids) == sorted(before)
    assert not stopped.sigkill
    assert group_members(report.pid) == []
    assert stopped.port_free and not service.status(transport).listening


def test_stop_escalates_to_sigkill_for_children_ignoring_sigterm(
        svc_host: ServiceHost, group_members: Callable[[int], list[int]]) -> None:
    transport = svc_host.transport(svc_host.spec(["--fork-children", "2", "--standin-ignore-sigterm"]))
    report = service.restart(transport)
    assert report.ready and report.pid is not None
    stopped = service.stop(transport, grace_s=0.5)
    assert stopped.sigkill and len(stopped.pids) == 3
    assert group_members(report.pid) == []
    assert stopped.port_free


def test_orphaned_children_are_stopped_after_the_leader_died(
        svc_host: ServiceHost, group_members: Callable[[int], list[int]]) -> None:
    spec = svc_host.spec(["--fork-children", "2", "--standin-start-delay", "30", "--standin-crash-after", "1"],
                         ready_timeout_s=60)
    transport = svc_host.transport(spec)
    started = service.start(transport)
    assert started.started and started.pid is not None
    waited = service.wait(transport, since_offset=started.log_offset)
    assert waited.reason in ("exited", "fatal_log")
    assert len(group_members(started.pid)) >= 2  # the children outlive their parent
    stopped = service.stop(transport, grace_s=5)
    assert stopped.was_running and group_members(started.pid) == []


def test_port_taken_before_start_names_the_owner(svc_host: ServiceHost) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", svc_host.port))
        squatter.listen()
        report = service.restart(svc_host.transport(svc_host.spec()))
    assert not report.ready and report.reason == "port_taken"
    assert [o.pid for o in report.port_owners] == [os.getpid()]
    assert f"port {svc_host.port}" in report.message and "python" in report.message
    with pytest.raises(ServiceError) as err:
        report.raise_for_failure()
    assert err.value.code == "server_port_taken"


def test_port_taken_while_loading_stops_the_wait(svc_host: ServiceHost) -> None:
    transport = svc_host.transport(svc_host.spec(["--standin-start-delay", "30"], ready_timeout_s=60))
    started = service.start(transport)
    assert started.started
    with socket.socket() as squatter:  # someone grabs the port while the model "loads"
        squatter.bind(("127.0.0.1", svc_host.port))
        squatter.listen()
        waited = service.wait(transport, since_offset=started.log_offset)
    assert waited.reason == "port_taken" and not waited.ready
    assert waited.waited_s < 30


def test_start_refusals_are_reports(svc_host: ServiceHost) -> None:
    transport = svc_host.transport(svc_host.spec())
    assert service.restart(transport).ready
    again = service.start(transport)
    assert not again.started and again.refusal == "already_running"
    bad = svc_host.transport(svc_host.spec(command=[str(svc_host.root / "no-such-server")]))
    service.stop(bad)
    refused = service.start(bad)
    assert refused.refusal == "spawn_failed" and "no-such-server" in refused.message


def test_wait_without_a_server_is_not_running(svc_host: ServiceHost) -> None:
    report = service.wait(svc_host.transport(svc_host.spec()))
    assert report.reason == "not_running" and not report.ready


def test_logs_tail_and_follow(svc_host: ServiceHost) -> None:
    transport = svc_host.transport(svc_host.spec())
    assert service.restart(transport).ready
    tail = service.logs(transport, n=3)
    assert len(tail.text.splitlines()) == 3
    log_path = Path(json.loads(Path(_state_file(svc_host, "server.json")).read_text())["log"])
    assert tail.text.splitlines() == log_path.read_text().splitlines()[-3:]
    assert service.status(transport).healthy  # the GET /health writes an access-log line
    follow = service.logs(transport, offset=tail.offset)
    assert '"GET /health HTTP/1.1" 200' in follow.text
    assert follow.offset > tail.offset
    assert service.logs(transport, offset=follow.offset).text == ""


def test_previous_log_is_kept_across_restarts(svc_host: ServiceHost) -> None:
    transport = svc_host.transport(svc_host.spec())
    first = service.restart(transport)
    second = service.restart(transport)
    assert first.ready and second.ready and first.pid != second.pid
    previous = Path(_state_file(svc_host, "server.log.1")).read_text()
    assert f"pid {first.pid}" not in Path(_state_file(svc_host, "server.log")).read_text()
    assert "fired up" in previous
    assert second.stop is not None and second.stop.was_running and second.stop.pids == [first.pid]


def _state_file(host: ServiceHost, name: str) -> Path:
    matches = list((host.root / "state").glob(f"*/server/{name}"))
    assert len(matches) == 1, matches
    return matches[0]


def test_a_readiness_wait_asks_again_as_soon_as_the_closed_port_opens() -> None:
    """Between two polls the wait watches a closed port; once it accepts, the next GET goes at once
    instead of a poll interval later (here a 30 s interval, so only waking early can pass)."""
    import http.server
    import threading
    import time

    from ddtree_deploy.hostside.service import _ReadyChecker

    class Healthy(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    checker = _ReadyChecker(port, "/health_generate", timeout=5.0)
    assert not checker.poll()
    servers: list[http.server.HTTPServer] = []
    opener = threading.Timer(0.5, lambda: servers.append(http.server.HTTPServer(("127.0.0.1", port), Healthy)))
    opener.start()
    started = time.monotonic()
    checker.wait(30.0)
    woke = time.monotonic() - started
    opener.join()
    (server,) = servers
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert woke < 15, f"slept {woke:.1f} s of a 30 s poll with the port open"
        assert not checker.poll()  # asks now
        checker.wait(30.0)  # wakes on the answer
        assert checker.poll() and checker.last["status"] == 200
    finally:
        server.shutdown()
        server.server_close()


def test_start_stop_and_launch_record_are_refused_without_the_host_lock(svc_host: ServiceHost) -> None:
    """Only the lock's holder drives the server: a second controller (another owner, its lock not taken)
    cannot stop or start it under a running push, and nothing about the server changes."""
    from ddtree_deploy.errors import HelperError
    from ddtree_deploy.remote import locks
    from ddtree_deploy.transport import LocalTransport

    holder = svc_host.transport(svc_host.spec())
    assert service.restart(holder).ready
    before = service.status(holder)
    intruder = LocalTransport(holder.host, owner="other")
    for call in (lambda: service.stop(intruder, grace_s=0), lambda: service.start(intruder),
                 lambda: locks.record_launch(intruder, ["x"], [])):
        with pytest.raises(HelperError) as refused:
            call()
        assert refused.value.code == "locked" and "locked by test" in str(refused.value)
    after = service.status(holder)
    assert (after.running, after.pid) == (before.running, before.pid) and after.running
    locks.unlock(holder)
    with pytest.raises(HelperError) as unlocked:
        service.stop(intruder, grace_s=0)
    assert unlocked.value.code == "not_locked" and service.status(holder).running
