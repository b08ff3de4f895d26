"""A controller that test_crash.py SIGKILLs mid-operation: `push SITE STATE SPEC` or `rollback SITE STATE`.

It drives the real helper through LocalTransport (a subprocess in the same process group, so one
killpg stops both); DDTREE_TEST_PAUSE_AT in the environment makes the helper wait at that point.
"""

from __future__ import annotations

import sys
from pathlib import Path

from store_helpers import OVERLAYS, local_transport

from ddtree_deploy import snapshot
from ddtree_deploy.overlay import load_overlay


def main(argv: list[str]) -> None:
    verb, site, state = argv[0], Path(argv[1]), Path(argv[2])
    t = local_transport(site, state)
    if verb == "push":
        overlay = load_overlay(argv[3], OVERLAYS)
        plan = snapshot.plan_for_host(t, overlay, "0.5.17", deployed=snapshot.deployed_state(t))
        taken = snapshot.take_snapshot(t, "pre-push")
        snapshot.apply_plan(t, plan, taken.id)
    else:
        snapshot.restore(t)


if __name__ == "__main__":
    main(sys.argv[1:])
