"""Dispatch: one JSON request line in, one JSON answer line out; each module's `OPS` table names its ops."""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback
from typing import Any, Callable, Dict, List

from .common import Context, HelperFailure

Op = Callable[[Context, Dict[str, Any]], Dict[str, Any]]


def collect_ops(module_names: List[str]) -> Dict[str, Op]:
    package = __name__.rsplit(".", 1)[0]
    ops: Dict[str, Op] = {}
    for name in module_names:
        module = importlib.import_module(package + "." + name)
        ops.update(getattr(module, "OPS", {}))
    return ops


def handle(request: Dict[str, Any], ops: Dict[str, Op]) -> Dict[str, Any]:
    """Run one op; refusals and crashes both become a JSON answer with a code."""
    op_name = request.get("op")
    try:
        if op_name not in ops:
            raise HelperFailure("unknown_op", "host helper has no op %r" % (op_name,),
                                "controller and helper disagree; reinstall ddtree-deploy")
        ctx = Context(request)
        return {"ok": True, "op": op_name, "data": ops[op_name](ctx, request.get("args") or {})}
    except HelperFailure as exc:
        error = {"code": exc.code, "message": exc.message, "hint": exc.hint, "details": exc.details}
        return {"ok": False, "op": op_name, "error": error}
    except OSError as exc:
        error = {"code": "os_error", "message": "%s: %s" % (exc.filename or op_name, exc.strerror or exc),
                 "hint": "check free space and permissions on the host", "details": {"errno": exc.errno}}
        return {"ok": False, "op": op_name, "error": error}
    except Exception as exc:  # a helper bug must still answer JSON, with evidence
        error = {"code": "helper_crashed", "message": "%s: %s" % (type(exc).__name__, exc),
                 "hint": "report this with the traceback", "details": {"traceback": traceback.format_exc()}}
        return {"ok": False, "op": op_name, "error": error}


def serve(module_names: List[str]) -> None:
    """Answer request lines from stdin until it closes (a JSON document holds no raw newline)."""
    ops = collect_ops(module_names)
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # a stray print, or a child process's output, goes to stderr, never into an answer
    for line in sys.stdin.buffer:
        if line.strip():
            answers.write(json.dumps(handle(json.loads(line), ops)) + "\n")
            answers.flush()
