"""Client of hostside/deployed.py: the deployed overlay marked verified, the installed files adopted as the baseline."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel

from ddtree_deploy.protocol import DeployedState
from ddtree_deploy.remote.store import SnapshotTaken

if TYPE_CHECKING:
    from ddtree_deploy.transport import Transport


class _Marked(BaseModel):
    deployed: DeployedState


class Adopted(BaseModel):
    """What `adopt` recorded: the snapshot now compared against, and state.json as it reads now."""

    snapshot: SnapshotTaken
    deployed: DeployedState


def mark_verified(t: Transport, digest: str) -> DeployedState:
    """Record that the probes of the overlay with `digest` passed on the host.

    Raises:
        HelperError: code state_changed (another overlay is deployed now), journal_open, locked / not_locked.
    """
    return t.run_helper("mark_verified", {"digest": digest}).parsed(_Marked).deployed


def adopt(t: Transport, fingerprint: dict[str, object] | None = None) -> Adopted:
    """Make the package as installed the baseline drift is measured against (no package file changes).

    Raises:
        HelperError: code journal_open, locked / not_locked, state_damaged, disk_full (nothing changed).
    """
    return t.run_helper("adopt", {"fingerprint": fingerprint}).parsed(Adopted)
