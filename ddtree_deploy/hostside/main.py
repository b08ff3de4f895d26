"""Dispatch: one request in, one JSON answer out; each module's `OPS` table names its ops."""

from __future__ import annotations

import importlib
import json
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


def handle(request: Dict[str, Any], module_names: List[str]) -> Dict[str, Any]:
    """Run one op; refusals and crashes both become a JSON answer with a code."""
    op_name = request.get("op")
    ops = collect_ops(module_names)
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


def main(request: Dict[str, Any], module_names: List[str]) -> None:
    sys.stdout.write(json.dumps(handle(request, module_names)))
    sys.stdout.flush()
