"""The bytes a push lands are those recorded before the overlays moved to inheritance (plan_digests.json)."""

from __future__ import annotations

import json

import pytest

from tests.overlay.plan_digests import DIGESTS, compute


@pytest.mark.timeout(120)
def test_every_version_lands_the_recorded_bytes() -> None:
    recorded = json.loads(DIGESTS.read_text())
    assert compute() == recorded
