"""A fake `systemctl`/`journalctl` pair for one unit (no systemd runs here): `fake_systemd.py TOOL ARGS...`.

Tests put two wrapper scripts named after the tools first on PATH.

State lives in $FAKE_SYSTEMD_DIR: the unit's command ($FAKE_SYSTEMD_COMMAND, a JSON argv) runs in its
own session like a systemd service, its output is the "journal" (one line per entry, the line number
is the cursor), and starts are recorded with their time so `--since @EPOCH` works.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

STATE = Path(os.environ["FAKE_SYSTEMD_DIR"])
JOURNAL, PID, STARTS = STATE / "journal", STATE / "pid", STATE / "starts.json"


def _pid() -> int | None:
    try:
        pid = int(PID.read_text())
        os.kill(pid, 0)
        stat = Path(f"/proc/{pid}/stat").read_text()
        return None if stat[stat.rindex(")") + 2] in "ZX" else pid
    except (OSError, ValueError):
        return None


def systemctl(args: list[str]) -> int:
    verb = args[0]
    if verb == "start":
        starts = json.loads(STARTS.read_text()) if STARTS.exists() else []
        lines = JOURNAL.read_text().count("\n") if JOURNAL.exists() else 0
        STARTS.write_text(json.dumps([*starts, [time.time(), lines]]))
        with JOURNAL.open("ab") as log:
            proc = subprocess.Popen(json.loads(os.environ["FAKE_SYSTEMD_COMMAND"]), stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        PID.write_text(str(proc.pid))
    elif verb == "stop":
        pid = _pid()
        if pid is not None:
            os.killpg(pid, signal.SIGTERM)
            while _pid() is not None:
                time.sleep(0.05)
    elif verb == "show":
        pid = _pid()
        state = "active" if pid else ("failed" if PID.exists() else "inactive")
        print(f"ActiveState={state}\nMainPID={pid or 0}")
    return 0


def journalctl(args: list[str]) -> int:
    lines = JOURNAL.read_text().splitlines() if JOURNAL.exists() else []
    begin = 0
    if "--since" in args:
        since = float(args[args.index("--since") + 1].lstrip("@"))
        starts = json.loads(STARTS.read_text()) if STARTS.exists() else []
        begin = next((at for t, at in starts if t >= since), len(lines))
    if "--after-cursor" in args:
        begin = int(args[args.index("--after-cursor") + 1].split("=")[1])
    shown = lines[begin:]
    if "-n" in args:
        count = int(args[args.index("-n") + 1])
        shown = shown[-count:] if count else []
    print("".join(line + "\n" for line in shown), end="")
    if "--show-cursor" in args:
        print(f"-- cursor: line={len(lines)}")
    return 0


if __name__ == "__main__":
    sys.exit(systemctl(sys.argv[2:]) if sys.argv[1] == "systemctl" else journalctl(sys.argv[2:]))
