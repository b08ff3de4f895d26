"""Counts and times as people read them."""

from __future__ import annotations

from ddtree_deploy.wording import duration, elapsed, moment, plural


def test_plural() -> None:
    assert [plural(n, "file") for n in (0, 1, 2)] == ["0 files", "1 file", "2 files"]
    assert (plural(1, "patch"), plural(3, "patch")) == ("1 patch", "3 patches")
    assert plural(2, "entry", "entries") == "2 entries"


def test_a_moment_is_iso_8601_utc_with_its_age() -> None:
    assert moment(1_796_169_235, now=1_796_169_235 + 300) == "2026-12-01T23:53:55Z (5 min ago)"
    assert moment(0, now=3 * 86400) == "1970-01-01T00:00:00Z (3 days ago)"
    assert [duration(s) for s in (42, 600, 7200, 86400, 2 * 86400)] == ["42 s", "10 min", "2 h", "24 h", "2 days"]


def test_a_running_time_counts_seconds() -> None:
    assert [elapsed(s) for s in (0.4, 42, 102, 3900)] == ["0 s", "42 s", "1 min 42 s", "1 h 05 min"]
