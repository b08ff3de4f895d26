"""Benchmark: time from the server's exit to `service.wait` reporting it at the controller (goal: <= 1 s).

On a sandbox host shaped like ct200 (real sglang release files, the host's own venv python), the
stand-in server is started through LocalTransport and told to crash (a Traceback, then exit 1)
before it becomes ready. The stand-in writes the wall time of its exit into the Traceback; the
latency is the controller's wall clock when `service.wait` returned minus that time. Two series:
with the default fatal patterns (the Traceback line is usually seen first) and with none (only the
process's exit is noticed). Usage, from the repo root: `python -m bench.detect [--runs 5] [--poll 0.25]`.
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from ddtree_deploy import service
from ddtree_deploy.inventory import DEFAULT_FATAL_PATTERNS, HostSpec, ProcessService
from ddtree_deploy.transport import LocalTransport
from sandbox.hosts import build_host

GOAL_S = 1.0
STANDIN = Path(__file__).resolve().parents[1] / "sandbox" / "standin_server.py"
EXIT_STAMP = re.compile(r"exiting at t=([0-9.]+)")


def one_run(host: HostSpec, fatal_patterns: list[str], crash_after: float) -> tuple[float, str]:
    """Start a server that crashes `crash_after` s in; return (exit -> report latency, reason)."""
    assert host.service is not None
    spec = host.service.model_copy(update={"fatal_patterns": fatal_patterns})
    transport = LocalTransport(host.model_copy(update={"service": spec}), owner="bench")
    service.stop(transport, grace_s=0)
    started = service.start(transport, ["--standin-crash-after", str(crash_after)])
    assert started.started, started.message
    report = service.wait(transport, since_offset=started.log_offset)
    reported_at = time.time()
    stamp = next((m.group(1) for line in report.log_tail if (m := EXIT_STAMP.search(line))), None)
    if stamp is None:
        raise SystemExit(f"no exit stamp in the log tail ({report.reason}): {report.log_tail[-5:]}")
    return reported_at - float(stamp), report.reason


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--poll", type=float, default=0.25, help="poll_interval_s of the service")
    parser.add_argument("--crash-after", type=float, default=1.5)
    opts = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ddtree-bench-detect-") as tmp:
        sandbox = build_host(Path(tmp) / "ct200", "ct200")
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        spec = ProcessService(command=[str(sandbox.python), str(STANDIN)], port=port, poll_interval_s=opts.poll,
                              args=["--model-path", "tiny", "--port", str(port), "--standin-start-delay", "60",
                                    "--standin-compile-cache", str(Path(tmp) / "compile-cache.json")],
                              ready_timeout_s=120)
        host = HostSpec(name="ct200", transport="local", python=str(sandbox.python),
                        package_root=str(sandbox.package_root), state_dir=str(sandbox.state_dir), service=spec)
        warm = time.monotonic()  # the first start compiles the whole release; later starts hit the cache
        subprocess.run([str(sandbox.python), str(STANDIN), "--standin-compile-only", *spec.args], check=True,
                       capture_output=True)
        print(f"warm-up: the stand-in byte-compiled the sglang release in {time.monotonic() - warm:.1f}s")
        results = {}
        for label, patterns in (("default fatal patterns", list(DEFAULT_FATAL_PATTERNS)), ("exit only", [])):
            runs = [one_run(host, patterns, opts.crash_after) for _ in range(opts.runs)]
            latencies = [lat for lat, _ in runs]
            median = statistics.median(latencies)
            results[label] = {"latencies_s": latencies, "median_s": median, "ratio_to_goal": median / GOAL_S,
                              "reasons": sorted({reason for _, reason in runs})}
            print(f"{label:24s} runs={opts.runs} poll={opts.poll}s  median {median * 1000:.0f} ms "
                  f"(min {min(latencies) * 1000:.0f}, max {max(latencies) * 1000:.0f})  "
                  f"ratio to the {GOAL_S:.0f} s goal: {median / GOAL_S:.2f}  reasons: {results[label]['reasons']}")
        service.stop(LocalTransport(host, owner="bench"), grace_s=0)
    print(json.dumps({"bench": "detect", "poll_s": opts.poll, "series": results}))


if __name__ == "__main__":
    main()
