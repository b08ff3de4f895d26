"""Overlay ddtree 0.3.0-rc.1: the start-up rules for hybrid targets (which linear-attention kinds
and options DDTREE takes) and the memory estimate of its per-node recurrent states, with
the numbers of the team's Qwen3.6-27B (48 GDN layers, 48 value heads of 128 x 128, fp32
SSM state; conv channels 2 x 16 x 128 + 48 x 128 = 10240, kernel 4, bf16)."""

from __future__ import annotations

import re
import sys
from types import ModuleType

import pytest

from ddtree_deploy.catalog import load_overlay
from tests.ddtree.conftest import OVERLAYS

MIB, GIB = 1 << 20, 1 << 30
HYBRID = "sglang/srt/speculative/ddtree_hybrid.py"


def hybrid_module() -> ModuleType:
    """0.3.0-rc.1's ddtree_hybrid.py (torch only), as the version lands it; registered in sys.modules
    first (dataclasses need it)."""
    name = "ddtree_hybrid_030"
    if name not in sys.modules:
        overlay = load_overlay("ddtree@0.3.0-rc.1", OVERLAYS)
        module = ModuleType(name)
        module.__file__ = f"{overlay.label}:{HYBRID}"
        sys.modules[name] = module
        exec(compile(overlay.content_of(HYBRID, None), module.__file__, "exec"), module.__dict__)
    return sys.modules[name]


@pytest.fixture(scope="module")
def hybrid() -> ModuleType:
    return hybrid_module()


def refusal(hybrid: ModuleType, **changes: object) -> str | None:
    args: dict[str, object] = dict(
        linear_kind="gdn", model_type="qwen3_5", architectures=["Qwen3_5ForConditionalGeneration"],
        enable_linear_replayssm_spec=False, enable_linear_replayssm=False,
        mamba_radix_cache_strategy="extra_buffer", max_running_requests=8,
    )
    args.update(changes)
    return hybrid.ddtree_hybrid_target_refusal(**args)


def test_a_gdn_hybrid_with_its_request_count_is_taken(hybrid: ModuleType) -> None:
    assert refusal(hybrid) is None
    assert refusal(hybrid, mamba_radix_cache_strategy="no_buffer") is None
    assert refusal(hybrid, linear_kind=None, max_running_requests=None) is None  # a plain target


@pytest.mark.parametrize(("kind", "name"), [
    ("mamba2", "Mamba2"), ("kda", "KDA"), ("lightning", "lightning attention"),
    ("ShortConvAttnBackend", "ShortConvAttnBackend"),
])
def test_other_linear_attention_kinds_are_refused_by_name(hybrid: ModuleType, kind: str, name: str) -> None:
    reason = refusal(hybrid, linear_kind=kind, model_type="nemotron_h", architectures=["NemotronHForCausalLM"])
    assert reason is not None and name in reason and "GatedDeltaNet" in reason
    assert "nemotron_h" in reason and "DFLASH" in reason


@pytest.mark.parametrize(("change", "flag"), [
    ({"enable_linear_replayssm_spec": True}, "--enable-linear-replayssm-spec"),
    ({"enable_linear_replayssm": True}, "--enable-linear-replayssm"),
    ({"mamba_radix_cache_strategy": "extra_buffer_lazy"}, "extra_buffer_lazy"),
    ({"max_running_requests": None}, "--max-running-requests"),
])
def test_unvalidated_options_are_refused_by_name(hybrid: ModuleType, change: dict[str, object], flag: str) -> None:
    reason = refusal(hybrid, **change)
    assert reason is not None and flag in reason


def test_track_interval_is_checked_against_the_block_size_not_the_budget(hybrid: ModuleType) -> None:
    # SGLang's default interval 256 serves budget 256 (verify width 257): a round commits
    # at most S = 16 tokens.
    assert hybrid.ddtree_mamba_track_refusal(extra_buffer=True, mamba_track_interval=256, block_size=16) is None
    assert hybrid.ddtree_mamba_track_refusal(extra_buffer=True, mamba_track_interval=16, block_size=16) is None
    reason = hybrid.ddtree_mamba_track_refusal(extra_buffer=True, mamba_track_interval=8, block_size=16)
    assert reason is not None and "--mamba-track-interval" in reason and ">= 16" in reason
    assert hybrid.ddtree_mamba_track_refusal(extra_buffer=False, mamba_track_interval=8, block_size=16) is None


def qwen36_27b(hybrid: ModuleType) -> object:
    return hybrid.DDTreeGDNStateSize(num_layers=48, ssm_bytes=48 * 128 * 128 * 4, conv_bytes=10240 * 3 * 2)


def test_qwen36_27b_state_per_node_and_request(hybrid: ModuleType) -> None:
    size = qwen36_27b(hybrid)
    assert size.ssm_bytes * size.num_layers == 144 * MIB
    assert round(size.conv_bytes * size.num_layers / MIB, 1) == 2.8
    # One request (the pool's padding row aside): budget + 1 snapshots and the committed state.
    per_request = {b: hybrid.ddtree_state_bytes(size, budget=b, max_running_requests=1) / 2 for b in (16, 64, 256)}
    assert [round(v / GIB, 2) for v in per_request.values()] == [2.58, 9.46, 36.99]


def test_memory_refusal_gives_the_numbers_and_the_largest_budget_that_fits(hybrid: ModuleType) -> None:
    size, limit = qwen36_27b(hybrid), 60 * GIB
    assert hybrid.ddtree_memory_refusal(size, budget=16, min_budget=15, max_running_requests=8,
                                        limit_bytes=limit, limit_source="test") is None
    reason = hybrid.ddtree_memory_refusal(size, budget=64, min_budget=15, max_running_requests=8,
                                          limit_bytes=limit, limit_source="test")
    assert reason is not None
    largest = hybrid.ddtree_largest_budget(size, max_running_requests=8, limit_bytes=limit)
    assert hybrid.ddtree_state_bytes(size, budget=largest, max_running_requests=8) <= limit
    assert hybrid.ddtree_state_bytes(size, budget=largest + 1, max_running_requests=8) > limit
    for text in ("--speculative-ddtree-budget 64", "--max-running-requests 8", "146.81 MiB per tree node",
                 "48 GDN layers", "60.00 GiB available (test)", f"the largest budget that fits is {largest}"):
        assert text in reason, text
    assert largest == 44


def test_memory_refusal_when_no_budget_fits_names_the_request_count_that_does(hybrid: ModuleType) -> None:
    size = qwen36_27b(hybrid)
    reason = hybrid.ddtree_memory_refusal(size, budget=16, min_budget=15, max_running_requests=48,
                                          limit_bytes=60 * GIB, limit_source="test")
    assert reason is not None and "no budget >= 15 fits" in reason
    fitting = int(re.search(r"at most (\d+) running requests fit", reason).group(1))  # type: ignore[union-attr]
    assert hybrid.ddtree_state_bytes(size, budget=15, max_running_requests=fitting) <= 60 * GIB
    assert hybrid.ddtree_state_bytes(size, budget=15, max_running_requests=fitting + 1) > 60 * GIB
