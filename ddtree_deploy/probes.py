"""Probes: what must hold after a restart (health, config, losslessness, sampling, metrics), as declared.

A `ProbeSpec` is one entry of an overlay manifest's or an inventory host's `probes:` list, validated
when that file loads; `probing.py` runs them against a host's server. Nothing here touches a host.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ddtree_deploy.divergence import DEFAULT_TIE_TOLERANCE


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class HttpProbe(_Strict):
    kind: Literal["http"]
    path: str = "/health"
    status: int = 200


class ServerInfoProbe(_Strict):
    kind: Literal["server_info"]
    expect: dict[str, Any]


class LosslessProbe(_Strict):
    kind: Literal["lossless"]
    prompts: list[str] = Field(min_length=1)
    max_new_tokens: int = Field(default=32, ge=32)
    tie_tolerance: float = Field(
        default=DEFAULT_TIE_TOLERANCE, ge=0,
        description="nats: a split to one of the reference's best few tokens this close to its choice is bf16 "
                    "rounding, reported and passed; 0 passes only identical answers")


class SampledProbe(_Strict):
    """One sampled request, timed. A server's first request with top_p < 1 compiles flashinfer's
    sampling kernels inside the scheduler (104 s on an H200, run 19), and every request waits for
    it: always on a speculative server (its verify calls them), and on a plain one unless it runs
    `--sampling-backend pytorch`. The probe makes the push pay that once, not the first user."""

    kind: Literal["sampled"]
    prompt: str = "the draft block is verified by the target"
    temperature: float = Field(default=0.8, gt=0)
    top_p: float = Field(default=0.95, gt=0, le=1)
    max_new_tokens: int = Field(default=16, ge=1)
    timeout_s: float = Field(default=300, gt=0, description="a first compile takes minutes")


class MetricsProbe(_Strict):
    kind: Literal["metrics"]
    name: str
    min: float | None = None
    max: float | None = None


ProbeSpec = Annotated[HttpProbe | ServerInfoProbe | LosslessProbe | SampledProbe | MetricsProbe,
                      Field(discriminator="kind")]
