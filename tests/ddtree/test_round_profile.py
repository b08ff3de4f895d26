"""0.3.0-rc.4's round profile (SGLANG_DDTREE_PROFILE=1): per-stage means from CUDA events, read without a wait.

CUDA events cannot run on this machine, so a stand-in Event (this file only) gives each mark a time on a
test clock and completes when the test says so; everything else is the overlay's own module.
"""

from __future__ import annotations

import json
import logging
from types import ModuleType

import pytest

from tests.ddtree.conftest import load_tool

PROFILE = "sglang/srt/speculative/ddtree_profile.py"


class FakeEvent:
    """A CUDA event stand-in: `record` stamps the test clock; `query` is True once the clock passed it."""

    clock = 0.0
    done_until = float("inf")

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at = -1.0

    def record(self, stream: object = None) -> None:
        self.at = FakeEvent.clock

    def query(self) -> bool:
        return self.at <= FakeEvent.done_until

    def elapsed_time(self, end: FakeEvent) -> float:
        return end.at - self.at


@pytest.fixture()
def profile(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    module = load_tool().load_overlay_module("ddtree@0.3.0-rc.4", PROFILE)
    monkeypatch.setattr(module.torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(module.torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(FakeEvent, "clock", 0.0)
    monkeypatch.setattr(FakeEvent, "done_until", float("inf"))
    return module


def _round(prof: object, gpu_ms: dict[str, float], bs: int) -> None:
    prof.start()  # type: ignore[attr-defined]
    for stage in gpu_ms:
        FakeEvent.clock += gpu_ms[stage]
        prof.mark(stage)  # type: ignore[attr-defined]
    prof.end(bs)  # type: ignore[attr-defined]


def _lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, object]]:
    return [json.loads(r.getMessage().split(" ", 1)[1]) for r in caplog.records
            if r.getMessage().startswith("ddtree_profile ")]


def test_off_by_default_and_every_call_a_no_op(profile: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SGLANG_DDTREE_PROFILE", raising=False)
    prof = profile.DDTreeRoundProfile.from_env("cuda")
    assert not prof.enabled
    _round(prof, dict.fromkeys(profile.STAGES, 1.0), bs=1)
    assert not prof._pending and prof._rounds == 0


def test_means_per_stage_over_every_rounds(profile: ModuleType, monkeypatch: pytest.MonkeyPatch,
                                           caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("SGLANG_DDTREE_PROFILE", "1")
    monkeypatch.setenv("SGLANG_DDTREE_PROFILE_EVERY", "2")
    prof = profile.DDTreeRoundProfile.from_env("cuda")
    stages = {s: float(i + 1) for i, s in enumerate(profile.STAGES)}  # draft 1 ms, tree_build 2 ms, ...
    caplog.set_level(logging.INFO)
    for bs in (1, 3, 2):  # a round is read at the next round's start: two rounds read by the third
        _round(prof, {s: v * bs for s, v in stages.items()}, bs)
    [line] = _lines(caplog)
    assert line["rounds"] == 2 and line["bs_mean"] == 2.0
    assert line["gpu_ms"] == {s: v * 2.0 for s, v in stages.items()}  # the mean of x1 and x3
    assert line["gpu_round_ms"] == pytest.approx(2.0 * sum(stages.values()))
    assert all(ms >= 0 for ms in line["host_ms"].values())  # type: ignore[union-attr]


def test_a_round_still_running_is_never_waited_for(profile: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLANG_DDTREE_PROFILE", "1")
    prof = profile.DDTreeRoundProfile.from_env("cuda")
    FakeEvent.done_until = -1.0  # nothing completes
    for _ in range(12):
        _round(prof, dict.fromkeys(profile.STAGES, 1.0), bs=1)
    assert prof._rounds == 0 and len(prof._pending) == 8  # kept, bounded, unread
    FakeEvent.done_until = float("inf")
    prof.start()
    assert prof._rounds == 8 and not prof._pending
