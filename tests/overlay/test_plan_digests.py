"""The bytes a push lands are those recorded before the overlays moved to inheritance (plan_digests.json)."""

from __future__ import annotations

import json

import pytest

from tests.overlay.plan_digests import DIGESTS, compute


@pytest.mark.timeout(120)
def test_every_recorded_version_lands_the_recorded_bytes() -> None:
    """Versions added since (new releases, new test overlays) have no record to keep."""
    recorded = json.loads(DIGESTS.read_text())
    computed = compute()
    assert {version: computed.get(version) for version in recorded} == recorded
