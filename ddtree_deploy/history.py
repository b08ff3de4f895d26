"""The local audit log: one JSON line per fleet operation, on the controller.

Hosts keep their own `history.jsonl` (written by the host helper); this file is the operator's
side: who ran what, against which hosts, and how each ended. Path: `$DDTREE_AUDIT_LOG`, else
`~/.local/state/ddtree-deploy/audit.jsonl`.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel

AUDIT_ENV = "DDTREE_AUDIT_LOG"


def audit_path() -> Path:
    return Path(os.environ.get(AUDIT_ENV) or Path.home() / ".local/state/ddtree-deploy/audit.jsonl")


def record(command: str, operator: str, report: BaseModel, **extra: Any) -> None:
    """Append one line: time, command, operator, and each host's outcome (never the whole evidence)."""
    data = report.model_dump(mode="json")
    hosts = {row["host"]: _outcome(row) for row in data.get("hosts", [])}
    line = {"time": time.time(), "command": command, "operator": operator, "hosts": hosts, **extra}
    path = audit_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(line, sort_keys=True) + "\n")


def _outcome(row: dict[str, Any]) -> str:
    if row.get("skipped"):
        return "skipped"
    if row.get("error"):
        return f"error: {row['error']['code']}"
    result = row.get("result") or {}
    return str(result.get("outcome", "ok"))


def read(limit: int = 20) -> list[dict[str, Any]]:
    path = audit_path()
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()[-limit:] if line.strip()]
