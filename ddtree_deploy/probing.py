"""Running probes against a host's server: health, config, losslessness, sampling and metrics, with their evidence.

Every request goes through the host helper's `http` op to the server on the host's own loopback, so
no server port needs to be reachable from the controller. Results keep their evidence (expected,
got, first differing token). The `lossless` probe compares greedy outputs with a `Reference`
recorded before the push (with the reference's top log-probs per token when its server decodes
plainly); speculative decoding is lossless, so any difference is a bug unless the reference's own best
tokens were near-tied there (divergence.py), which bf16 numerics explain and the result reports.
Nothing here restarts anything.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field

from ddtree_deploy import divergence
from ddtree_deploy.divergence import TopLogprobs
from ddtree_deploy.errors import ProbeError
from ddtree_deploy.probes import LosslessProbe, ProbeSpec
from ddtree_deploy.remote import service as remote
from ddtree_deploy.remote.service import HttpAnswer
from ddtree_deploy.wording import plural

if TYPE_CHECKING:
    from ddtree_deploy.transport import Transport


class ReferenceOutput(BaseModel):
    prompt: str
    max_new_tokens: int
    output_ids: list[int]
    top_logprobs: TopLogprobs | None = None  # None: the server gave none (every split is then a mismatch)


class Reference(BaseModel):
    """Greedy answers of the server before a change: what the lossless probes compare against."""

    host: str
    recorded_at: float
    outputs: list[ReferenceOutput] = Field(default_factory=list)

    def lookup(self, prompt: str, max_new_tokens: int) -> ReferenceOutput | None:
        for out in self.outputs:
            if out.prompt == prompt and out.max_new_tokens == max_new_tokens:
                return out
        return None


class ProbeResult(BaseModel):
    """One probe's verdict with its evidence."""

    kind: str
    name: str = Field(description="what was checked, e.g. 'http /health' or 'metrics sglang:spec_accept_length'")
    status: Literal["pass", "fail", "skipped"]
    message: str
    expected: Any = None
    got: Any = None
    first_diff: int | None = Field(default=None, description="lossless: index of the first differing token")
    prompt: str | None = None
    details: dict[str, Any] = Field(default_factory=dict)
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status != "fail"


def http_request(transport: Transport, path: str, *, method: str = "GET", body: Any = None,
                 timeout: float = 60.0, port: int | None = None) -> HttpAnswer:
    """One request to the server on the host's loopback (default port: the host's service port)."""
    return remote.http(transport, port or _port(transport), path, method=method, body=body, timeout=timeout)


class Generation(BaseModel):
    """One answer: the token ids, and SGLang's per-request `meta_info` (acceptance length etc.)."""

    output_ids: list[int]
    meta_info: dict[str, Any] = Field(default_factory=dict)


def generate_greedy(transport: Transport, prompt: str, max_new_tokens: int, *, logprobs: bool = False
                    ) -> Generation:
    """Greedy `/generate` of one prompt; raises `ProbeError` (with the answer) if no output ids come back.

    `ignore_eos` makes every answer `max_new_tokens` long, so an early end-of-sequence can never keep
    the probe from reaching the speculative decode path. `logprobs` asks for the top log-probs per
    token as well (`divergence.TOP_TOKENS` of them) (meta_info's `output_top_logprobs`).
    """
    body: dict[str, Any] = {"text": prompt, **(divergence.LOGPROB_REQUEST if logprobs else {}),
                            "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens,
                                                "ignore_eos": True}}
    answer = http_request(transport, "/generate", method="POST", body=body)
    try:
        return Generation.model_validate_json(answer.body)
    except ValueError:
        raise ProbeError(
            f"/generate answered {answer.status or answer.error}: {answer.body[:200]!r}", host=transport.host.name,
            code="generate_failed", hint="is the server up? see ddtree-deploy logs --host HOST",
            details={"status": answer.status, "error": answer.error},
        ) from None


def record_reference(transport: Transport, specs: Sequence[ProbeSpec]) -> Reference:
    """Record the greedy answers every lossless probe in `specs` will be compared with, with their
    top log-probs when the server decodes plainly (see `_plain_decoding`).

    Raises:
        ProbeError: the server did not answer a prompt (call this only while the server is healthy).
    """
    ref = Reference(host=transport.host.name, recorded_at=time.time())
    lossless = [spec for spec in specs if isinstance(spec, LosslessProbe)]
    logprobs = bool(lossless) and _plain_decoding(transport)
    for spec in lossless:
        for prompt in spec.prompts:
            if ref.lookup(prompt, spec.max_new_tokens) is None:
                answer = generate_greedy(transport, prompt, spec.max_new_tokens, logprobs=logprobs)
                ref.outputs.append(ReferenceOutput(prompt=prompt, max_new_tokens=spec.max_new_tokens,
                                                   output_ids=answer.output_ids,
                                                   top_logprobs=divergence.top_logprobs(answer.meta_info)))
    return ref


def _plain_decoding(transport: Transport) -> bool:
    """Whether the live server decodes without a speculative algorithm, the only case where asking for
    log-probs is safe: SGLang 0.5.17's DFLASH worker (and every DDTREE version) raises on
    `return_logprob` inside the scheduler, which takes the whole server down. A speculative reference
    is recorded without them, so every split from it is a mismatch."""
    try:
        info = json.loads(http_request(transport, "/server_info").body)
    except ValueError:
        return False
    return isinstance(info, dict) and "speculative_algorithm" in info and not info["speculative_algorithm"]


def run_probes(transport: Transport, specs: Sequence[ProbeSpec], reference: Reference | None = None
               ) -> list[ProbeResult]:
    """Run every probe, in order; a failing probe is a result, only an unreachable host raises."""
    results = []
    for spec in specs:
        started = time.monotonic()
        result = _RUNNERS[spec.kind](transport, spec, reference)
        results.append(result.model_copy(update={"duration_s": time.monotonic() - started}))
    return results


def _run_http(transport: Transport, spec: Any, reference: Reference | None) -> ProbeResult:
    answer = http_request(transport, spec.path)
    got = answer.status if answer.status is not None else answer.error
    ok = answer.status == spec.status
    return ProbeResult(kind="http", name=f"http {spec.path}", status="pass" if ok else "fail",
                       message=f"GET {spec.path} -> {got}" + ("" if ok else f", expected {spec.status}"),
                       expected=spec.status, got=got)


def _run_server_info(transport: Transport, spec: Any, reference: Reference | None) -> ProbeResult:
    answer = http_request(transport, "/server_info")
    try:
        info = json.loads(answer.body)
        assert isinstance(info, dict)
    except (ValueError, AssertionError):
        return ProbeResult(kind="server_info", name="server_info", status="fail", expected=spec.expect,
                           message=f"/server_info answered {answer.status or answer.error}, not a JSON object",
                           got=answer.body[:200])
    missing = object()
    wrong = {k: info.get(k, missing) for k, v in spec.expect.items() if info.get(k, missing) != v}
    got = {k: ("<absent>" if v is missing else v) for k, v in wrong.items()}
    if not wrong:
        return ProbeResult(kind="server_info", name="server_info", status="pass", expected=spec.expect,
                           got={k: info[k] for k in spec.expect},
                           message="server_info has " + ", ".join(f"{k}={v!r}" for k, v in spec.expect.items()))
    return ProbeResult(kind="server_info", name="server_info", status="fail",
                       expected={k: spec.expect[k] for k in wrong}, got=got,
                       message="server_info differs: " + ", ".join(
                           f"{k} is {got[k]!r}, expected {spec.expect[k]!r}" for k in wrong))


def _run_lossless(transport: Transport, spec: Any, reference: Reference | None) -> ProbeResult:
    name = f"lossless ({plural(len(spec.prompts), 'prompt')}, {plural(spec.max_new_tokens, 'token')})"
    if reference is None:
        return ProbeResult(kind="lossless", name=name, status="skipped",
                           message="no reference was recorded (the server was not up before the change)")
    compared, accept, ties = 0, [], []
    for prompt in spec.prompts:
        recorded = reference.lookup(prompt, spec.max_new_tokens)
        if recorded is None:
            continue
        answer = generate_greedy(transport, prompt, spec.max_new_tokens)
        compared += 1
        if "spec_accept_length" in answer.meta_info:  # per-request evidence; SGLang's gauge lags behind
            accept.append(answer.meta_info["spec_accept_length"])
        split = divergence.compare(recorded.output_ids, answer.output_ids, recorded.top_logprobs,
                                   spec.tie_tolerance)
        if split.kind == "near_tie":
            ties.append({"prompt": prompt, **split.model_dump()})
        elif split.kind == "mismatch":
            return ProbeResult(kind="lossless", name=name, status="fail", prompt=prompt, first_diff=split.index,
                               expected=recorded.output_ids, got=answer.output_ids,
                               details={"spec_accept_length": accept, "near_ties": ties, "gap": split.gap},
                               message=f"greedy output for prompt {prompt[:40]!r} differs from the reference "
                                       f"at {split.describe()}, of {len(recorded.output_ids)} tokens")
    if not compared:
        return ProbeResult(kind="lossless", name=name, status="skipped",
                           message="the reference has none of these prompts")
    mean = f"; mean acceptance length {sum(accept) / len(accept):.2f}" if accept else ""
    exact = compared - len(ties)
    tied = (f", {len(ties)} part from it at a near-tie of the reference (gaps "
            + ", ".join(f"{t['gap']:.3f}" for t in ties) + f" nats, tolerance {spec.tie_tolerance})") if ties else ""
    return ProbeResult(kind="lossless", name=name, status="pass",
                       details={"spec_accept_length": accept, "near_ties": ties},
                       message=f"{exact}/{len(spec.prompts)} prompts answer exactly as the reference{tied}{mean}")


#: A sampled answer this slow on a server that answers greedy ones in well under a second is the compile.
SLOW_SAMPLE_S = 10.0


def _run_sampled(transport: Transport, spec: Any, reference: Reference | None) -> ProbeResult:
    params = {"temperature": spec.temperature, "top_p": spec.top_p, "max_new_tokens": spec.max_new_tokens,
              "ignore_eos": True}
    name = f"sampled (T={spec.temperature:g}, top_p={spec.top_p:g})"
    answer = http_request(transport, "/generate", method="POST", timeout=spec.timeout_s,
                          body={"text": spec.prompt, "sampling_params": params})
    took = f"{answer.elapsed_s:.1f} s"
    try:
        tokens = len(Generation.model_validate_json(answer.body).output_ids)
    except ValueError:
        tokens = 0
    if not tokens:
        return ProbeResult(kind="sampled", name=name, status="fail", expected=params,
                           got=answer.status if answer.status is not None else answer.error,
                           message=f"no sampled answer in {took} (limit {spec.timeout_s:g} s): "
                                   f"{answer.error or answer.body[:120]!r}")
    return ProbeResult(kind="sampled", name=name, status="pass", expected=params, got=tokens,
                       details={"elapsed_s": answer.elapsed_s},
                       message=f"{plural(tokens, 'sampled token')} in {took}"
                               + (" (most likely the first compile of the sampling kernels, which later "
                                  "requests do not wait for)" if answer.elapsed_s > SLOW_SAMPLE_S else ""))


def _run_metrics(transport: Transport, spec: Any, reference: Reference | None) -> ProbeResult:
    from prometheus_client.parser import text_string_to_metric_families  # only metrics probes pay its import

    name = f"metrics {spec.name}"
    bounds = {"min": spec.min, "max": spec.max}
    answer = http_request(transport, "/metrics")
    if answer.status != 200:
        return ProbeResult(kind="metrics", name=name, status="fail", expected=bounds,
                           got=answer.status or answer.error,
                           message=f"/metrics answered {answer.status or answer.error} (is --enable-metrics set?)")
    values = [sample.value for family in text_string_to_metric_families(answer.body)
              for sample in family.samples if spec.name in (sample.name, family.name)]
    if not values:
        return ProbeResult(kind="metrics", name=name, status="fail", expected=bounds, got=None,
                           message=f"metric {spec.name} is not exported")
    bad = [v for v in values if (spec.min is not None and v < spec.min) or (spec.max is not None and v > spec.max)]
    return ProbeResult(kind="metrics", name=name, status="fail" if bad else "pass", expected=bounds,
                       got=values if len(values) > 1 else values[0],
                       message=f"{spec.name} = {', '.join(f'{v:g}' for v in values)}"
                               + (f", outside [{spec.min}, {spec.max}]" if bad else ""))


_RUNNERS: dict[str, Callable[[Transport, Any, Reference | None], ProbeResult]] = {
    "http": _run_http, "server_info": _run_server_info, "lossless": _run_lossless, "sampled": _run_sampled,
    "metrics": _run_metrics,
}


def _port(transport: Transport) -> int:
    service = transport.host.service
    if service is None:
        raise ProbeError(f"{transport.host.name} has no service block to probe", host=transport.host.name,
                         code="no_service", hint="add a `service:` block (with its port) to the host")
    return service.port
