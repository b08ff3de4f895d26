#!/usr/bin/env python3
"""Summarise a hybrid DDTREE debug server's `ddtree_debug` lines: rounds, acceptance, how many
rounds the conv kernel derived the tree's parents from the links, and the committed-state
check (conv window bit-exact, SSM state within its tolerance of the fp32 chain oracle).

usage: hybrid_debug_summary.py LABEL SERVER_LOG
Prints one line STATE_CHECK[LABEL] ... ok=k/n.
"""
from __future__ import annotations

import collections
import json
import sys


def main() -> None:
    label, log = sys.argv[1], sys.argv[2]
    rows = [json.loads(line.split("ddtree_debug ", 1)[1]) for line in open(log, errors="replace")
            if "ddtree_debug {" in line]
    checks = [r["state_check"] for r in rows if r.get("state_check", {}).get("checked")]
    parents = [r.get("link_parents_ok") for r in rows]
    hist = collections.Counter(r["accept_length"] for r in rows)
    ok = sum(bool(c["ok"]) for c in checks)
    worst = max(checks, key=lambda c: c["ssm_max_abs"] / max(c["ssm_scale"], 1.0), default=None)
    print(f"STATE_CHECK[{label}] rounds={len(rows)} accept_hist={dict(sorted(hist.items()))} "
          f"link_parents_ok={sum(p is True for p in parents)}/{len(parents)} checked={len(checks)} "
          f"conv_exact={sum(bool(c['conv_exact']) for c in checks)}/{len(checks)} "
          f"max_conv_abs={max((c['conv_max_abs'] for c in checks), default=None)} "
          f"worst_ssm={worst and (worst['ssm_max_abs'], worst['ssm_scale'])} ok={ok}/{len(checks)}")


if __name__ == "__main__":
    main()
