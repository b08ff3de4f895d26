"""Host fingerprints and the compatibility rules between a host, an overlay and a snapshot.

A `Fingerprint` is what the host helper's `fingerprint` op read (hostside/facts.py). The rules are
pure functions over fingerprints and manifests; each returns every `AbiProblem` it finds (empty
means go), each naming the host, the field, what was found and what was required.
`raise_problems` turns the errors among them into one `AbiError`. Nothing here runs a command.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version
from pydantic import BaseModel, ConfigDict, Field, ValidationError, computed_field, field_validator

from ddtree_deploy.errors import AbiError, HelperError

KERNEL_PACKAGES = ("sglang-kernel", "sgl-kernel")  # the same kernels, renamed; import name sgl_kernel
FLASHINFER_PACKAGES = ("flashinfer-python", "flashinfer")
_VARIANT = re.compile(r"^cu(\d+)(\d)$")  # cu128 -> CUDA 12.8, cu130 -> 13.0, cu118 -> 11.8

# Driver minimums, Linux x86_64, from NVIDIA's CUDA Toolkit Release Notes, section "CUDA Driver"
# (https://docs.nvidia.com/cuda/cuda-toolkit-release-notes/index.html#cuda-driver).
#
# Table "CUDA Toolkit and Minimum Required Driver Version for CUDA Minor Version Compatibility":
# any toolkit of a major release runs on a driver of at least this version. We ENFORCE this floor:
# torch's pip wheels bundle their own CUDA runtime (nvidia-*-cu12 / -cu13 wheels) and rely on exactly
# this minor-version compatibility, so below it the CUDA runtime cannot initialise at all (short of
# NVIDIA's forward-compatibility package, cuda-compat, on datacenter GPUs, which we do not detect).
MINOR_VERSION_COMPAT_FLOOR = {11: "450.80.02", 12: "525.60.13", 13: "580"}
# Table "CUDA Toolkit and Corresponding Driver Versions" (the GA release of each minor; an update of a
# minor may list a slightly newer driver). Below this but above the floor the runtime works under
# minor-version compatibility, where NVIDIA documents that PTX newer than the driver cannot be JIT
# compiled and features that need the newer driver are missing: we WARN, not refuse.
TOOLKIT_DRIVER = {
    "11.8": "520.61.05",
    "12.0": "525.60.13",
    "12.1": "530.30.02",
    "12.2": "535.54.03",
    "12.3": "545.23.06",
    "12.4": "550.54.14",
    "12.5": "555.42.02",
    "12.6": "560.28.03",
    "12.8": "570.26",
    "12.9": "575.51.03",
    "13.0": "580.65.06",
    "13.1": "590.44.01",
}


class _Lenient(BaseModel):
    # Fingerprints are also read back from old snapshots: tolerate fields added or dropped since.
    model_config = ConfigDict(extra="ignore")


class PackageInfo(_Lenient):
    """One installed distribution, as its dist-info says."""

    name: str | None = None
    version: str | None = None
    location: str | None = Field(default=None, description="folder holding the dist-info")
    requires: list[str] = Field(default_factory=list, description="Requires-Dist lines naming tracked packages")


class GpuInfo(_Lenient):
    name: str
    compute_cap: str | None = None


class DeepCheck(_Lenient):
    """What a real `import torch` / `import sgl_kernel` on the host said (`--deep`)."""

    error: str | None = Field(default=None, description="the check itself failed (crash, hang, no answer)")
    torch_imported: bool = False
    torch_error: str | None = None
    torch_version: str | None = None
    torch_cuda: str | None = None
    cxx11_abi: bool | None = None
    cuda_available: bool | None = None
    capabilities: list[str] = Field(default_factory=list)
    sgl_kernel_imported: bool | None = None
    sgl_kernel_error: str | None = None
    warnings: list[str] = Field(default_factory=list)


class Fingerprint(_Lenient):
    """A host's python environment: interpreter, sglang stack, torch build, driver and GPUs."""

    python_version: str
    python_implementation: str = "CPython"
    python_executable: str = ""
    python_prefix: str = ""
    abi_tag: str | None = None
    soabi: str | None = None
    platform: dict[str, str] = Field(default_factory=dict, description="PEP 508 marker environment of the host")
    package_root: str = ""
    packages: dict[str, PackageInfo] = Field(default_factory=dict, description="canonical name -> dist-info facts")
    torch_version: str | None = Field(default=None, description="torch/version.py __version__, local tag included")
    torch_cuda: str | None = Field(default=None, description="torch.version.cuda, e.g. 12.8; None for CPU builds")
    torch_hip: str | None = None
    torch_version_error: str | None = Field(default=None, description="why torch/version.py could not be read")
    driver_version: str | None = None
    gpus: list[GpuInfo] = Field(default_factory=list)
    nvidia_smi_error: str | None = None
    deep: DeepCheck | None = None

    @classmethod
    def from_helper(cls, data: Mapping[str, Any], host: str | None = None) -> Fingerprint:
        """Read the `fingerprint` op's answer (or a snapshot's copy of one)."""
        try:
            return cls.model_validate(dict(data))
        except ValidationError as exc:
            raise HelperError(f"fingerprint answer is malformed: {exc.errors()[0]['msg']}", host=host,
                              code="bad_fingerprint", hint="controller and helper disagree; reinstall ddtree-deploy") from None

    def version_of(self, *names: str) -> str | None:
        """Version of the first of `names` installed (aliases such as sglang-kernel / sgl-kernel)."""
        for name in names:
            info = self.packages.get(name)
            if info is not None and info.version:
                return info.version
        return None

    @computed_field  # type: ignore[prop-decorator]
    @property
    def sglang_version(self) -> str | None:
        return self.version_of("sglang")

    @computed_field  # type: ignore[prop-decorator]
    @property
    def kernel_version(self) -> str | None:
        return self.version_of(*KERNEL_PACKAGES)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def flashinfer_version(self) -> str | None:
        return self.version_of(*FLASHINFER_PACKAGES)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def torch_local(self) -> str | None:
        """The local tag of torch's version (cu128, cu130, cpu, rocm6.3) or None."""
        version = _version(self.torch_version)
        return version.local if version is not None else None

    @computed_field  # type: ignore[prop-decorator]
    @property
    def cuda_variant(self) -> str | None:
        """cu128 / cu130 ...: the local tag, else derived from torch.version.cuda (PyPI's untagged default wheel)."""
        local = self.torch_local
        if local and _VARIANT.match(local):
            return local
        return variant_of_cuda(self.torch_cuda) if self.torch_cuda else None

    @property
    def cuda_release(self) -> str | None:
        """The CUDA release torch was built with: torch.version.cuda, else read off the variant."""
        return self.torch_cuda or cuda_of_variant(self.cuda_variant)

    @property
    def variant_label(self) -> str:
        """The build for messages: cu128, or cpu / rocm6.3 / no torch."""
        if self.torch_version is None:
            return "no torch"
        return self.cuda_variant or self.torch_local or "cpu"


class Requires(BaseModel):
    """An overlay's `requires:` block: what the host's stack must be."""

    model_config = ConfigDict(extra="forbid")

    torch: str | None = Field(default=None, description="PEP 440 specifier on torch's release, local tag ignored")
    cuda: list[str] | None = Field(default=None, description="allowed torch CUDA variants (cu128, cu130); omit = any")
    python: str | None = Field(default=None, description="PEP 440 specifier on the host python's version")

    @field_validator("torch", "python")
    @classmethod
    def _specifier(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                SpecifierSet(value)
            except InvalidSpecifier:
                raise ValueError(f"not a PEP 440 version specifier: {value!r} (e.g. '>=2.11,<2.12')") from None
        return value

    @field_validator("cuda")
    @classmethod
    def _variants(cls, value: list[str] | None) -> list[str] | None:
        for variant in value or []:
            if not _VARIANT.match(variant):
                raise ValueError(f"not a torch CUDA variant: {variant!r} (e.g. cu128, cu130)")
        return value


class ArtifactBuild(BaseModel):
    """One entry of an overlay's `artifacts:`: compiled files under files-<cuda>/ and the torch they were built against."""

    model_config = ConfigDict(extra="forbid")

    torch: str = Field(description="torch release the artifacts were built against, e.g. 2.11.0")
    files: list[str] = Field(default_factory=list)

    @field_validator("torch")
    @classmethod
    def _release(cls, value: str) -> str:
        if _version(value) is None:
            raise ValueError(f"not a PEP 440 version: {value!r}")
        return value


class AbiProblem(BaseModel):
    """One failed rule on one host."""

    host: str
    field: str = Field(description="what was compared, e.g. cuda_variant or sglang-kernel.requires.torch")
    found: str
    required: str
    message: str = Field(description="one sentence naming what was found and what was required")
    hint: str = ""
    severity: Literal["error", "warning"] = "error"

    def line(self) -> str:
        return f"{self.host}: {self.field}: {self.message}"


class ArtifactSelection(BaseModel):
    folder: str | None = Field(default=None, description="files-<cuda> folder to install, None if no artifacts")
    problems: list[AbiProblem] = Field(default_factory=list)


def variant_of_cuda(cuda: str) -> str | None:
    """12.8 -> cu128."""
    match = re.match(r"^(\d+)\.(\d)(\.\d+)?$", cuda)  # a two-digit minor has no cuXYZ name
    return f"cu{match.group(1)}{match.group(2)}" if match else None


def cuda_of_variant(variant: str | None) -> str | None:
    """cu128 -> 12.8."""
    match = _VARIANT.match(variant or "")
    return f"{match.group(1)}.{match.group(2)}" if match else None


def _version(text: str | None) -> Version | None:
    try:
        return Version(text) if text else None
    except InvalidVersion:
        return None


def _within(version: str | None, specifier: str) -> bool:
    parsed = _version(version)
    return parsed is not None and SpecifierSet(specifier).contains(parsed, prereleases=True)


def _driver_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version))


def _one_of(variants: Iterable[str]) -> str:
    names = list(variants)
    return names[0] if len(names) == 1 else "one of " + ", ".join(names)


# --- rules -----------------------------------------------------------------------------------


def check_requires(host: str, fp: Fingerprint, requires: Requires) -> list[AbiProblem]:
    """An overlay's `requires` (torch range, CUDA variants, python range) against the host."""
    problems = []
    if requires.torch is not None and not _within(_public(fp.torch_version), requires.torch):
        problems.append(AbiProblem(
            host=host, field="torch", found=fp.torch_version or "not installed", required=requires.torch,
            message=f"overlay needs torch {requires.torch}, host has {fp.torch_version or 'no torch'}",
            hint="pick an overlay version built for this torch, or upgrade the host's torch"))
    if requires.cuda is not None and fp.cuda_variant not in requires.cuda:
        wanted = _one_of(requires.cuda)
        problems.append(AbiProblem(
            host=host, field="cuda_variant", found=fp.variant_label, required=wanted,
            message=f"overlay needs torch CUDA variant {wanted}, host has {fp.variant_label} (torch {fp.torch_version})",
            hint=f"this overlay has no build for {fp.variant_label}; never copy packages between CUDA variants"))
    if requires.python is not None and not _within(fp.python_version, requires.python):
        problems.append(AbiProblem(
            host=host, field="python", found=fp.python_version, required=requires.python,
            message=f"overlay needs python {requires.python}, host python is {fp.python_version}",
            hint="point the inventory's python at an environment in range"))
    return problems


def _public(version: str | None) -> str | None:
    parsed = _version(version)
    return parsed.public if parsed is not None else None


def check_host_stack(host: str, fp: Fingerprint) -> list[AbiProblem]:
    """The host's own stack is consistent: package pins, torch metadata, driver, and the `--deep` import check."""
    return [
        *check_pins(host, fp),
        *check_torch_metadata(host, fp),
        *check_driver(host, fp),
        *check_deep(host, fp),
    ]


def check_pins(host: str, fp: Fingerprint) -> list[AbiProblem]:
    """Each installed package's Requires-Dist on another tracked package (torch, kernels, ...) holds."""
    problems = []
    for name, info in fp.packages.items():
        for requirement in _requirements(info, fp.platform):
            dep = _canonical(requirement.name)
            installed = fp.packages.get(dep)
            field = f"{name}.requires.{dep}"
            spec = str(requirement.specifier)
            if installed is None or not installed.version:
                problems.append(AbiProblem(
                    host=host, field=field, found="not installed", required=spec or "installed", severity="warning",
                    message=f"{name} {info.version} requires {dep}{spec}, which is not installed"))
            elif not requirement.specifier.contains(_version(installed.version) or installed.version, prereleases=True):
                problems.append(AbiProblem(
                    host=host, field=field, found=installed.version, required=spec,
                    message=f"{name} {info.version} requires {dep}{spec}, host has {dep} {installed.version}",
                    hint=f"install the {name} build made for {dep} {installed.version}, or the {dep} it pins"))
    return problems


def _requirements(info: PackageInfo, environment: Mapping[str, str]) -> list[Requirement]:
    """Requires-Dist lines that apply on the host (markers evaluated as the host would, no extras)."""
    out = []
    for line in info.requires:
        try:
            requirement = Requirement(line)
        except InvalidRequirement:
            continue  # a malformed pin in someone else's metadata is pip's concern, not an ABI fact
        if requirement.marker is None or requirement.marker.evaluate({**environment, "extra": ""}):
            out.append(requirement)
    return out


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def torch_pin(fp: Fingerprint, names: Iterable[str]) -> str | None:
    """The torch specifiers the first installed of `names` requires on the host ("any" for an unpinned one)."""
    for name in names:
        info = fp.packages.get(name)
        if info is not None:
            pins = [str(r.specifier) or "any" for r in _requirements(info, fp.platform) if _canonical(r.name) == "torch"]
            return ", ".join(pins) or None
    return None


def check_torch_metadata(host: str, fp: Fingerprint) -> list[AbiProblem]:
    """torch's dist-info, version.py and local tag tell the same story (a copied package often does not)."""
    problems = []
    if fp.torch_version_error:
        problems.append(AbiProblem(
            host=host, field="torch.version", found=fp.torch_version_error, required="a readable torch/version.py",
            message=f"torch's build is unknown: {fp.torch_version_error}",
            hint="torch is damaged (a partial copy?); reinstall it with pip"))
    dist = fp.version_of("torch")
    if dist and fp.torch_version and not _same_build(dist, fp.torch_version):
        problems.append(AbiProblem(
            host=host, field="torch.version", found=fp.torch_version, required=dist,
            message=f"torch/version.py says {fp.torch_version} but torch's dist-info says {dist}",
            hint="torch was overwritten by hand; reinstall it with pip"))
    tagged = cuda_of_variant(fp.torch_local)
    if tagged and fp.torch_cuda and tagged != fp.torch_cuda:
        problems.append(AbiProblem(
            host=host, field="torch_cuda", found=fp.torch_cuda, required=tagged,
            message=f"torch {fp.torch_version} is tagged for CUDA {tagged} but torch.version.cuda is {fp.torch_cuda}",
            hint="torch files from another CUDA variant were copied in; reinstall torch with pip"))
    return problems


def _same_build(dist: str, module: str) -> bool:
    """dist-info and version.py agree; PyPI's wheels carry no local tag in their metadata (dist-info
    `2.11.0`, version.py `2.11.0+cu130`, as on the team's H200 box), so an untagged dist-info matches any tag."""
    a, b = _version(dist), _version(module)
    if a is None or b is None:
        return dist == module
    return a.public == b.public and (a.local is None or a.local == b.local)


def check_driver(host: str, fp: Fingerprint) -> list[AbiProblem]:
    """The NVIDIA driver runs torch's CUDA release: refuse below the minor-version floor, warn below the toolkit driver."""
    cuda = fp.cuda_release
    if not fp.driver_version or not cuda:
        return []
    found = _driver_tuple(fp.driver_version)
    major = int(cuda.split(".")[0])
    floor = MINOR_VERSION_COMPAT_FLOOR.get(major)
    if floor is not None and found < _driver_tuple(floor):
        return [AbiProblem(
            host=host, field="driver_version", found=fp.driver_version, required=f">={floor}",
            message=f"torch {fp.torch_version} needs CUDA {major}.x, which needs NVIDIA driver >={floor}; "
                    f"host driver is {fp.driver_version}",
            hint=f"upgrade the driver (R{floor.split('.')[0]} or newer), or install a torch build for an older CUDA")]
    toolkit = TOOLKIT_DRIVER.get(cuda)
    if toolkit is not None and found < _driver_tuple(toolkit):
        return [AbiProblem(
            host=host, field="driver_version", found=fp.driver_version, required=f">={toolkit}", severity="warning",
            message=f"driver {fp.driver_version} is older than CUDA {cuda}'s toolkit driver {toolkit}: runs only "
                    "under minor-version compatibility (no JIT of newer PTX)",
            hint=f"upgrade the driver to {toolkit} or newer")]
    return []


def check_deep(host: str, fp: Fingerprint) -> list[AbiProblem]:
    """What a real import said, when `--deep` ran: torch imports, matches its metadata, sees the GPUs; kernels import."""
    deep = fp.deep
    if deep is None:
        return []
    if deep.error:
        return [AbiProblem(host=host, field="deep", found=deep.error, required="an answer", message=deep.error,
                           hint="run the host's python by hand: python -c 'import torch, sgl_kernel'")]
    problems = []
    if fp.torch_version and not deep.torch_imported:
        problems.append(AbiProblem(
            host=host, field="deep.torch", found=deep.torch_error or "import failed", required="import torch",
            message=f"import torch failed: {deep.torch_error}", hint="reinstall torch with pip"))
    if deep.torch_imported and deep.torch_version != fp.torch_version:
        problems.append(AbiProblem(
            host=host, field="deep.torch_version", found=str(deep.torch_version), required=str(fp.torch_version),
            message=f"import torch gave {deep.torch_version} but the installed metadata says {fp.torch_version}",
            hint="another torch shadows the environment's (PYTHONPATH, user site); remove it"))
    if deep.torch_imported and fp.cuda_variant and fp.gpus and not deep.cuda_available:
        problems.append(AbiProblem(
            host=host, field="deep.cuda_available", found="False", required="True",
            message=f"torch {deep.torch_version} sees no CUDA device although nvidia-smi lists {len(fp.gpus)} GPU(s)"
                    + (f": {deep.warnings[0]}" if deep.warnings else ""),
            hint="check the driver and CUDA_VISIBLE_DEVICES"))
    if fp.kernel_version and deep.sgl_kernel_imported is False:
        problems.append(AbiProblem(
            host=host, field="deep.sgl_kernel", found=deep.sgl_kernel_error or "import failed", required="import sgl_kernel",
            message=f"import sgl_kernel failed: {deep.sgl_kernel_error}",
            hint="the kernel build does not match torch or the CUDA variant; reinstall the one sglang pins"))
    return problems


def select_artifacts(host: str, fp: Fingerprint, artifacts: Mapping[str, ArtifactBuild]) -> ArtifactSelection:
    """Pick the overlay's `files-<cuda>/` build for this host; refuse when none matches its CUDA variant and torch."""
    if not artifacts:
        return ArtifactSelection()
    variant = fp.cuda_variant
    build = artifacts.get(variant) if variant else None
    if build is None:
        wanted = _one_of(artifacts)
        return ArtifactSelection(problems=[AbiProblem(
            host=host, field="artifacts", found=fp.variant_label, required=wanted,
            message=f"overlay has compiled artifacts for {wanted}, none for the host's {fp.variant_label}",
            hint=f"build the overlay's artifacts for {fp.variant_label} (files-{fp.variant_label}/)")])
    if _public(build.torch) != _public(fp.torch_version):
        return ArtifactSelection(problems=[AbiProblem(
            host=host, field=f"artifacts.{variant}.torch", found=fp.torch_version or "no torch", required=build.torch,
            message=f"files-{variant}/ was built against torch {build.torch}, host has torch {fp.torch_version}",
            hint=f"rebuild files-{variant}/ against torch {_public(fp.torch_version)}")])
    return ArtifactSelection(folder=f"files-{variant}")


#: (field, reader) compared between the fingerprint a snapshot was taken under and the host's now
_SNAPSHOT_FIELDS: list[tuple[str, Callable[[Fingerprint], str | None]]] = [
    ("torch", lambda fp: fp.torch_version),
    ("cuda_variant", lambda fp: fp.variant_label),
    ("python", lambda fp: ".".join(fp.python_version.split(".")[:2])),
    ("abi_tag", lambda fp: fp.abi_tag),
]


def check_snapshot_compat(host: str, fp_now: Fingerprint, fp_snapshot: Fingerprint) -> list[AbiProblem]:
    """A snapshot restores files built for the stack it was taken under: list every difference since."""
    problems = []
    for field, read in _SNAPSHOT_FIELDS:
        then, now = read(fp_snapshot), read(fp_now)
        if then != now:
            problems.append(AbiProblem(
                host=host, field=field, found=str(now), required=str(then),
                message=f"snapshot was taken with {field} {then}, host now has {now}",
                hint="restoring it may not import; pass --force if you are sure"))
    return problems


def errors_of(problems: Iterable[AbiProblem]) -> list[AbiProblem]:
    return [p for p in problems if p.severity == "error"]


def raise_problems(problems: Iterable[AbiProblem], *, code: str | None = None, hint: str | None = None) -> None:
    """Raise one `AbiError` listing every error among `problems` (warnings alone pass).

    Raises:
        AbiError: message "<host>: <field>: <found/required>; ..." on one line, every problem in
            `details["problems"]`.
    """
    all_problems = list(problems)
    errors = errors_of(all_problems)
    if not errors:
        return
    hosts = sorted({p.host for p in errors})
    host = hosts[0] if len(hosts) == 1 else None
    lines = [f"{p.field}: {p.message}" if host else p.line() for p in errors]
    message = (f"{host}: " if host else "") + "; ".join(lines)
    hints = list(dict.fromkeys(p.hint for p in errors if p.hint))
    raise AbiError(message, host=host, code=code, hint=hint if hint is not None else "; ".join(hints),
                   details={"problems": [p.model_dump() for p in all_problems]})
