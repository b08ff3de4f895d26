"""Probes against the stand-in server through the helper's loopback `http` op: pass, fail with evidence, skip."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from ddtree_deploy import service
from ddtree_deploy.errors import ProbeError
from ddtree_deploy.probes import HttpProbe, LosslessProbe, MetricsProbe, ProbeSpec, SampledProbe, ServerInfoProbe
from ddtree_deploy.probing import (
    ProbeResult,
    generate_greedy,
    http_request,
    record_reference,
    run_probes,
)

if TYPE_CHECKING:
    from ddtree_deploy.transport import LocalTransport
    from tests.service.conftest import ServiceHost

DDTREE_ARGS = ["--speculative-algorithm", "DDTREE", "--speculative-ddtree-budget", "64"]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]
LOSSLESS = LosslessProbe(kind="lossless", prompts=PROMPTS, max_new_tokens=32)


def _up(host: ServiceHost, *extra: str, log_interval: int = 1) -> LocalTransport:
    """A DDTREE stand-in; the acceptance gauge is refreshed every `log_interval` decode forwards."""
    transport = host.transport(host.spec())
    report = service.restart(transport, [*DDTREE_ARGS, "--decode-log-interval", str(log_interval), *extra])
    assert report.ready, report.log_tail
    return transport


def _by_kind(results: list[ProbeResult]) -> dict[str, ProbeResult]:
    return {r.kind: r for r in results}


def test_all_probe_kinds_pass_on_a_healthy_ddtree_server(svc_host: ServiceHost) -> None:
    transport = _up(svc_host)
    reference = record_reference(transport, [LOSSLESS])
    assert [o.prompt for o in reference.outputs] == PROMPTS
    assert all(len(o.output_ids) == 32 for o in reference.outputs)
    specs: list[ProbeSpec] = [
        HttpProbe(kind="http", path="/health_generate"),
        ServerInfoProbe(kind="server_info", expect={"speculative_algorithm": "DDTREE",
                                                    "speculative_ddtree_budget": 64, "version": "0.5.17"}),
        LOSSLESS,
        MetricsProbe(kind="metrics", name="sglang:spec_accept_length", min=1.0),
    ]
    results = run_probes(transport, specs, reference)
    assert [r.status for r in results] == ["pass"] * 4, [r.message for r in results]
    got = _by_kind(results)
    assert got["server_info"].got == {"speculative_algorithm": "DDTREE", "speculative_ddtree_budget": 64,
                                      "version": "0.5.17"}
    assert isinstance(got["metrics"].got, float) and got["metrics"].got >= 1.0
    assert "3/3 prompts" in got["lossless"].message
    accept = got["lossless"].details["spec_accept_length"]
    assert len(accept) == 3 and all(a > 1 for a in accept)


def test_acceptance_gauge_lags_like_sglang_but_lossless_has_per_request_evidence(svc_host: ServiceHost) -> None:
    # Measured on the real server (bench/service_real.py): with the default decode_log_interval of 40,
    # three 32-token DDTREE answers leave sglang:spec_accept_length at 0.
    reference = record_reference(_up(svc_host), [LOSSLESS])
    transport = _up(svc_host, log_interval=40)  # the restart of a push: fresh counters
    lossless, gauge = run_probes(transport, [LOSSLESS, MetricsProbe(kind="metrics", name="sglang:spec_accept_length",
                                                                     min=1.0)], reference)
    assert lossless.status == "pass" and min(lossless.details["spec_accept_length"]) > 1
    assert gauge.status == "fail" and gauge.got == 0.0


def test_lossless_mismatch_names_prompt_and_first_differing_token(svc_host: ServiceHost) -> None:
    reference = record_reference(_up(svc_host), [LOSSLESS])
    lossy = _up(svc_host, "--standin-corrupt-outputs")  # a restart with a "buggy" decoder
    [result] = run_probes(lossy, [LOSSLESS], reference)
    assert result.status == "fail" and not result.ok
    assert result.prompt == PROMPTS[0]
    recorded = reference.lookup(PROMPTS[0], 32)
    assert recorded and result.expected == recorded.output_ids
    assert isinstance(result.expected, list) and isinstance(result.got, list)
    first = next(i for i, (a, b) in enumerate(zip(result.expected, result.got, strict=False)) if a != b)
    assert result.first_diff == first and result.expected[:first] == result.got[:first]
    assert f"at token {first}: expected" in result.message and "of 32 tokens" in result.message
    assert result.details["gap"] is None  # the corrupted token is not the reference's runner-up


def _plain(host: ServiceHost) -> LocalTransport:
    transport = host.transport(host.spec())
    report = service.restart(transport, [])
    assert report.ready, report.log_tail
    return transport


def test_a_speculative_reference_is_recorded_without_log_probs_and_its_server_lives(svc_host: ServiceHost) -> None:
    transport = _up(svc_host)  # DDTREE: return_logprob would kill it, as it kills SGLang's DFLASH/DDTREE servers
    reference = record_reference(transport, [LOSSLESS])
    assert reference.outputs and all(out.top_logprobs is None for out in reference.outputs)
    assert run_probes(transport, [HttpProbe(kind="http", path="/health")])[0].status == "pass"
    with pytest.raises(ProbeError):  # the stand-in does die on it, so the test above means something
        generate_greedy(transport, PROMPTS[0], 32, logprobs=True)


def test_reference_keeps_the_top_two_log_probs_of_every_token(svc_host: ServiceHost) -> None:
    reference = record_reference(_plain(svc_host), [LOSSLESS])
    for out in reference.outputs:
        assert out.top_logprobs and len(out.top_logprobs) == 32
        assert all(len(row) == 2 and row[0][0] >= row[1][0] for row in out.top_logprobs)
        assert [row[0][1] for row in out.top_logprobs] == out.output_ids


def test_lossless_passes_splits_at_near_ties_and_names_each_but_not_with_tolerance_zero(svc_host: ServiceHost) -> None:
    reference = record_reference(_plain(svc_host), [LOSSLESS])
    ties = _up(svc_host, "--standin-tie-flips", "0.3")  # bf16-like: the runner-up where it is within 0.3 nats
    [result] = run_probes(ties, [LOSSLESS], reference)
    assert result.status == "pass", result.message
    near = result.details["near_ties"]
    assert near and all(t["kind"] == "near_tie" and 0 <= t["gap"] <= 0.3 for t in near)
    assert "near-tie of the reference" in result.message and f"{len(PROMPTS) - len(near)}/3 prompts" in result.message
    strict = LosslessProbe(kind="lossless", prompts=PROMPTS, max_new_tokens=32, tie_tolerance=0)
    [failed] = run_probes(ties, [strict], reference)
    assert failed.status == "fail" and "at a near-tie" not in failed.message and "gap" in failed.message


def test_lossless_without_reference_is_skipped_not_passed(svc_host: ServiceHost) -> None:
    [result] = run_probes(_up(svc_host), [LOSSLESS], None)
    assert result.status == "skipped" and result.ok
    assert "no reference" in result.message


def test_server_info_mismatch_and_absent_field_are_evidence(svc_host: ServiceHost) -> None:
    spec = ServerInfoProbe(kind="server_info", expect={"speculative_algorithm": "DFLASH",
                                                       "speculative_ddtree_budget": 64, "ddtree_tree_depth": 8})
    [result] = run_probes(_up(svc_host), [spec])
    assert result.status == "fail"
    assert result.expected == {"speculative_algorithm": "DFLASH", "ddtree_tree_depth": 8}
    assert result.got == {"speculative_algorithm": "DDTREE", "ddtree_tree_depth": "<absent>"}
    assert "speculative_algorithm is 'DDTREE', expected 'DFLASH'" in result.message


def test_metrics_out_of_bounds_and_missing(svc_host: ServiceHost) -> None:
    transport = _up(svc_host)
    assert generate_greedy(transport, "warm up", 32).meta_info["spec_accept_length"] > 1  # refreshes the gauge
    specs = [MetricsProbe(kind="metrics", name="sglang:spec_accept_length", max=1.0),
             MetricsProbe(kind="metrics", name="sglang:ddtree_nodes_per_step", min=1.0),
             MetricsProbe(kind="metrics", name="sglang:generation_tokens", min=32)]
    bounded, missing, counter = run_probes(transport, specs)
    assert bounded.status == "fail" and "outside [None, 1.0]" in bounded.message
    assert isinstance(bounded.got, float) and bounded.got > 1.0
    assert missing.status == "fail" and "not exported" in missing.message
    assert counter.status == "pass"  # a counter matches by family name (prometheus strips _total)


def test_metrics_probe_explains_a_server_without_metrics(svc_host: ServiceHost) -> None:
    spec = svc_host.spec()
    spec = spec.model_copy(update={"args": [a for a in spec.args if a != "--enable-metrics"]})
    transport = svc_host.transport(spec)
    assert service.restart(transport).ready
    [result] = run_probes(transport, [MetricsProbe(kind="metrics", name="sglang:spec_accept_length", min=1)])
    assert result.status == "fail" and result.got == 404 and "--enable-metrics" in result.message


def test_http_probe_against_a_dead_server_fails_with_the_error(svc_host: ServiceHost) -> None:
    transport = svc_host.transport(svc_host.spec())
    [result] = run_probes(transport, [HttpProbe(kind="http", path="/health")])
    assert result.status == "fail" and result.expected == 200
    assert isinstance(result.got, str) and "refused" in result.got.lower()


def test_reference_needs_a_live_server(svc_host: ServiceHost) -> None:
    with pytest.raises(ProbeError) as err:
        record_reference(svc_host.transport(svc_host.spec()), [LOSSLESS])
    assert err.value.code == "generate_failed" and err.value.host == "sbx"


def test_http_request_reports_status_and_body(svc_host: ServiceHost) -> None:
    transport = _up(svc_host)
    missing = http_request(transport, "/no_such_path")
    assert missing.status == 404 and "Not Found" in missing.body and missing.error is None


def test_the_sampled_probe_pays_the_first_compile_and_later_requests_do_not_wait(svc_host: ServiceHost) -> None:
    transport = _up(svc_host, "--standin-first-sample-delay", "2")
    probe = SampledProbe(kind="sampled")
    first, second = run_probes(transport, [probe, probe])
    assert (first.status, second.status) == ("pass", "pass"), (first.message, second.message)
    assert first.got == second.got == 16 and "16 sampled tokens in" in first.message
    assert first.details["elapsed_s"] >= 2 > second.details["elapsed_s"] + 1


def test_the_sampled_probe_fails_when_no_answer_comes_in_time(svc_host: ServiceHost) -> None:
    transport = _up(svc_host, "--standin-first-sample-delay", "3")
    [result] = run_probes(transport, [SampledProbe(kind="sampled", timeout_s=0.5)])
    assert result.status == "fail" and result.message.startswith("no sampled answer in ")
    assert "(limit 0.5 s)" in result.message


@pytest.mark.parametrize(("args", "waits"), [([], True), (["--sampling-backend", "pytorch"], False)])
def test_a_plain_server_waits_for_the_compile_unless_it_samples_with_torch(
        svc_host: ServiceHost, args: list[str], waits: bool) -> None:
    transport = svc_host.transport(svc_host.spec())
    assert service.restart(transport, ["--standin-first-sample-delay", "2", *args]).ready
    [result] = run_probes(transport, [SampledProbe(kind="sampled")])
    assert result.status == "pass" and (result.details["elapsed_s"] >= 2) == waits
