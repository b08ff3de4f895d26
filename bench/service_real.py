"""Bench on the GPU machine: the service layer and probes against the real SGLang 0.5.17 server.

Runs there from the repo root (GPU.md: `/tmp/site` unpacked, `/tmp/models` built, `PYTHONPATH=/tmp/site:.`)
through a `transport: local` host whose package root is `/tmp/site`:
  1. restart on the hand-set copy model (plain), record the lossless reference, probe;
  2. restart with DFLASH (the stop of step 1 shows SGLang's process group going away), probe:
     server_info, lossless against the plain reference, speculative metrics;
  3. stop, and check that no process holds GPU memory;
  4. break the installed DFLASH worker modules (a raise at import, as a bad overlay would), restart,
     and time how long after the server's last log write the failure is reported; restore the files.
Writes `service_real.json` to --out after every step. Usage: `python3 -m bench.service_real --out DIR`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ddtree_deploy import service
from ddtree_deploy.inventory import HostSpec, ProcessService
from ddtree_deploy.probes import HttpProbe, LosslessProbe, MetricsProbe, ProbeSpec, ServerInfoProbe
from ddtree_deploy.probing import record_reference, run_probes
from ddtree_deploy.protocol import LockController
from ddtree_deploy.remote import locks
from ddtree_deploy.transport import LocalTransport

SITE = Path("/tmp/site")
PORT = 30000
BASE = [
    "--host",
    "127.0.0.1",
    "--port",
    str(PORT),
    "--model-path",
    "/tmp/models/target_copy",
    "--attention-backend",
    "triton",
    "--sampling-backend",
    "pytorch",
    "--mem-fraction-static",
    "0.05",
    "--max-total-tokens",
    "32768",
    "--context-length",
    "2048",
    "--disable-cuda-graph",
    "--random-seed",
    "0",
    "--enable-metrics",
    "--log-level",
    "info",
]
DFLASH = ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", "/tmp/models/dflash_copy"]
LOSSLESS = LosslessProbe(
    kind="lossless",
    max_new_tokens=48,
    prompts=[
        "hello world the model token",
        "the draft block is verified by the target",
        "one two three four five six seven eight nine ten",
    ],
)
BROKEN = ["sglang/srt/speculative/dflash_worker_v2.py"]


def gpu_apps() -> list[str]:
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    return [line for line in out.splitlines() if line.strip()]


def probe_rows(transport: LocalTransport, specs: list[ProbeSpec], reference: Any) -> list[dict[str, Any]]:
    return [
        {"name": r.name, "status": r.status, "message": r.message, "first_diff": r.first_diff}
        for r in run_probes(transport, specs, reference)
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    parser.add_argument("--only-broken", action="store_true", help="run step 4 alone")
    opts = parser.parse_args()
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}

    def save(key: str, value: Any) -> None:
        results[key] = value
        (out / "service_real.json").write_text(json.dumps(results, indent=1, default=str))
        print(key, json.dumps(value, default=str)[:1500], flush=True)

    spec = ProcessService(
        command=[sys.executable, "-m", "sglang.launch_server"],
        args=BASE,
        port=PORT,
        ready_timeout_s=240,
        stop_grace_s=20,
    )
    host = HostSpec(
        name="gpu",
        transport="local",
        python=sys.executable,
        package_root=str(SITE),
        state_dir="/tmp/ddtree-state",
        service=spec,
    )
    transport = LocalTransport(host, owner="bench")
    # the server's start and stop belong to the host lock's holder, as in a playbook after preflight
    locks.lock(transport, ttl_s=3600, controller=LockController(host="gpu", pid=os.getpid()))

    if not opts.only_broken:
        healthy_steps(transport, save)
    broken_step(transport, save)


def healthy_steps(transport: LocalTransport, save: Callable[[str, Any], None]) -> None:
    """Steps 1-3: plain, DFLASH against the plain reference, stop."""
    plain = service.restart(transport)
    save("1_restart_plain", plain.model_dump(exclude={"log_tail"}) | {"log_tail": plain.log_tail[-8:]})
    if not plain.ready:
        return
    status = service.status(transport)
    save("1_status", status.model_dump())
    reference = record_reference(transport, [LOSSLESS])
    save("1_reference", [{"prompt": o.prompt, "ids": o.output_ids[:12]} for o in reference.outputs])
    save(
        "1_probes",
        probe_rows(
            transport,
            [
                HttpProbe(kind="http", path="/health_generate"),
                ServerInfoProbe(kind="server_info", expect={"speculative_algorithm": None, "version": "0.5.17"}),
                LOSSLESS,
                MetricsProbe(kind="metrics", name="sglang:prompt_tokens", min=1),
            ],
            reference,
        ),
    )

    dflash = service.restart(transport, DFLASH)
    save("2_restart_dflash", dflash.model_dump(exclude={"log_tail"}) | {"log_tail": dflash.log_tail[-8:]})
    if dflash.ready:
        save(
            "2_probes",
            probe_rows(
                transport,
                [
                    ServerInfoProbe(kind="server_info", expect={"speculative_algorithm": "DFLASH"}),
                    LOSSLESS,
                    MetricsProbe(kind="metrics", name="sglang:spec_accept_length", min=1.0),
                ],
                reference,
            ),
        )

    stopped = service.stop(transport)
    save("3_stop", stopped.model_dump() | {"gpu_apps_after": gpu_apps()})


def broken_step(transport: LocalTransport, save: Callable[[str, Any], None]) -> None:
    """Step 4: a DFLASH worker that raises at import; how soon after the server's last write is it reported."""
    for rel in BROKEN:
        shutil.copy2(SITE / rel, SITE / (rel + ".orig"))
        with open(SITE / rel, "a") as f:
            f.write('\nraise RuntimeError("ddtree-deploy bench: injected import failure")\n')
    try:
        broken = service.restart(transport, DFLASH)
        reported = time.time()
        log = Path(json.loads(next(Path("/tmp/ddtree-state").glob("*/server/server.json")).read_text())["log"])
        save(
            "4_broken_restart",
            {
                "ready": broken.ready,
                "reason": broken.reason,
                "message": broken.message,
                "waited_s": broken.waited_s,
                "report_after_last_log_write_s": reported - log.stat().st_mtime,
                "log_tail": broken.log_tail[-12:],
            },
        )
        save("4_stop", service.stop(transport).model_dump() | {"gpu_apps_after": gpu_apps()})
    finally:
        for rel in BROKEN:
            os.replace(SITE / (rel + ".orig"), SITE / rel)


if __name__ == "__main__":
    main()
