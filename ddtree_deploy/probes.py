"""Probes: what must hold after a restart (health, config, losslessness, metrics).

The probe *specs* declared by overlays and the inventory live here; running them is added by the
service issue.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field


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


class MetricsProbe(_Strict):
    kind: Literal["metrics"]
    name: str
    min: float | None = None
    max: float | None = None


ProbeSpec = Annotated[Union[HttpProbe, ServerInfoProbe, LosslessProbe, MetricsProbe], Field(discriminator="kind")]
