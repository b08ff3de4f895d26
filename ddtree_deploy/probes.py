"""Probes: what must hold after a restart (health, config, losslessness, metrics), as declared.

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


class MetricsProbe(_Strict):
    kind: Literal["metrics"]
    name: str
    min: float | None = None
    max: float | None = None


ProbeSpec = Annotated[HttpProbe | ServerInfoProbe | LosslessProbe | MetricsProbe, Field(discriminator="kind")]
