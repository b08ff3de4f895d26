"""The `abi` command's matrix: the fleet's fingerprints side by side, one column per host, one row per field.

Data only (`build_matrix`); `commands/abi.py` imports it once the fingerprints are read, and renders it.
"""

from __future__ import annotations

from collections.abc import Callable

from pydantic import BaseModel, Field, computed_field

from ddtree_deploy.abi import (
    FLASHINFER_PACKAGES,
    KERNEL_PACKAGES,
    AbiProblem,
    Fingerprint,
    check_host_stack,
    errors_of,
    torch_pin,
)

#: (row label, reader) of the matrix, in display order; a row that is empty on every host is dropped
_MATRIX_ROWS: list[tuple[str, Callable[[Fingerprint], str | None]]] = [
    ("python", lambda fp: fp.python_version),
    ("abi tag", lambda fp: fp.abi_tag),
    ("sglang", lambda fp: fp.sglang_version),
    ("torch", lambda fp: fp.torch_version),
    ("cuda variant", lambda fp: fp.variant_label),
    ("torch.version.cuda", lambda fp: fp.torch_cuda),
    ("sglang-kernel", lambda fp: _named_version(fp, KERNEL_PACKAGES)),
    ("flashinfer", lambda fp: _named_version(fp, FLASHINFER_PACKAGES)),
    ("triton", lambda fp: fp.version_of("triton")),
    ("torchvision", lambda fp: fp.version_of("torchvision")),
    ("torchaudio", lambda fp: fp.version_of("torchaudio")),
    ("sglang torch pin", lambda fp: torch_pin(fp, ("sglang",))),
    ("sglang-kernel torch pin", lambda fp: torch_pin(fp, KERNEL_PACKAGES)),
    ("flashinfer torch pin", lambda fp: torch_pin(fp, FLASHINFER_PACKAGES)),
    ("torchvision torch pin", lambda fp: torch_pin(fp, ("torchvision",))),
    ("torchaudio torch pin", lambda fp: torch_pin(fp, ("torchaudio",))),
    ("driver", lambda fp: fp.driver_version),
    ("gpus", lambda fp: _gpus(fp)),
    ("compute capability", lambda fp: ", ".join(sorted({g.compute_cap or "?" for g in fp.gpus})) or None),
    ("deep: import torch", lambda fp: _flag(fp.deep.torch_imported) if fp.deep else None),
    ("deep: cuda available", lambda fp: _flag(fp.deep.cuda_available) if fp.deep else None),
    ("deep: cxx11 abi", lambda fp: _flag(fp.deep.cxx11_abi) if fp.deep else None),
    ("deep: import sgl_kernel", lambda fp: _flag(fp.deep.sgl_kernel_imported) if fp.deep else None),
]


def _named_version(fp: Fingerprint, names: tuple[str, ...]) -> str | None:
    """The version, with the distribution's name when it is an alias (sgl-kernel 0.3.9)."""
    for name in names:
        version = fp.version_of(name)
        if version:
            return version if name == names[0] else f"{name} {version}"
    return None


def _gpus(fp: Fingerprint) -> str | None:
    counts: dict[str, int] = {}
    for gpu in fp.gpus:
        counts[gpu.name] = counts.get(gpu.name, 0) + 1
    return ", ".join(f"{n}x {name}" for name, n in counts.items()) or None


def _flag(value: bool | None) -> str | None:
    return None if value is None else ("yes" if value else "no")


class MatrixRow(BaseModel):
    field: str
    values: dict[str, str | None] = Field(description="host -> value (None: absent, or host unreachable)")
    differs: bool = Field(description="the reachable hosts disagree")


class HostColumn(BaseModel):
    host: str
    fingerprint: Fingerprint | None = None
    error: dict[str, str] | None = Field(default=None, description="{code, message, hint} when unreachable")
    problems: list[AbiProblem] = Field(default_factory=list, description="the host's own stack (check_host_stack)")

    @computed_field  # type: ignore[prop-decorator]
    @property
    def consistent(self) -> bool:
        """The host answered and no rule of its own stack failed (warnings allowed)."""
        return self.fingerprint is not None and not errors_of(self.problems)


class AbiMatrix(BaseModel):
    """The fleet side by side: one column per host, one row per field, differing fields flagged."""

    hosts: list[str]
    rows: list[MatrixRow]
    columns: list[HostColumn]

    @computed_field  # type: ignore[prop-decorator]
    @property
    def consistent(self) -> bool:
        """Every host answered and its own stack is consistent."""
        return all(column.consistent for column in self.columns)


def build_matrix(columns: list[HostColumn]) -> AbiMatrix:
    """Rows from the columns' fingerprints; problems are filled in from `check_host_stack` where missing."""
    filled = [c.model_copy(update={"problems": c.problems or check_host_stack(c.host, c.fingerprint)})
              if c.fingerprint is not None else c for c in columns]
    rows = []
    for label, read in _MATRIX_ROWS:
        values = {c.host: read(c.fingerprint) if c.fingerprint is not None else None for c in filled}
        if all(v is None for v in values.values()):
            continue
        seen = {values[c.host] for c in filled if c.fingerprint is not None}
        rows.append(MatrixRow(field=label, values=values, differs=len(seen) > 1))
    return AbiMatrix(hosts=[c.host for c in filled], rows=rows, columns=filled)
