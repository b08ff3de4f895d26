"""The ABI rules, every rule a row: a fingerprint (and a manifest part) in, the failing fields out."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from ddtree_deploy import abi
from ddtree_deploy.commands._abi_matrix import HostColumn, build_matrix
from ddtree_deploy.errors import AbiError, HelperError

SGLANG_PINS = ["torch==2.11.0", "sglang-kernel==0.4.5", "flashinfer_python[cu13]==0.6.15.post1"]


def fingerprint(**changes: Any) -> abi.Fingerprint:
    """ct200 as the team runs it (torch 2.11.0+cu128, a consistent stack), with `changes` applied."""
    data: dict[str, Any] = {
        "python_version": "3.11.7", "abi_tag": "cp311",
        "platform": {"sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
                     "python_version": "3.11"},
        "packages": {
            "sglang": {"name": "sglang", "version": "0.5.17", "requires": SGLANG_PINS},
            "torch": {"name": "torch", "version": "2.11.0+cu128", "requires": []},
            "sglang-kernel": {"name": "sglang-kernel", "version": "0.4.5", "requires": ["torch==2.11.0"]},
            "flashinfer-python": {"name": "flashinfer-python", "version": "0.6.15.post1", "requires": []},
        },
        "torch_version": "2.11.0+cu128", "torch_cuda": "12.8",
        "driver_version": "570.124.06", "gpus": [{"name": "NVIDIA H200", "compute_cap": "9.0"}],
    }
    data.update(changes)
    return abi.Fingerprint.from_helper(data)


def cu130(**changes: Any) -> abi.Fingerprint:
    """ct129: the same stack on torch 2.11.0+cu130 with an R580 driver."""
    packages = dict(fingerprint().model_dump()["packages"])
    packages["torch"] = {"name": "torch", "version": "2.11.0+cu130", "requires": []}
    return fingerprint(**{"packages": packages, "torch_version": "2.11.0+cu130", "torch_cuda": "13.0",
                          "driver_version": "580.95.05", **changes})


def with_package(name: str, version: str, requires: list[str]) -> dict[str, Any]:
    packages = dict(fingerprint().model_dump()["packages"])
    packages[name] = {"name": name, "version": version, "requires": requires}
    return packages


def deep(**values: Any) -> dict[str, Any]:
    base = {"torch_imported": True, "torch_version": "2.11.0+cu128", "torch_cuda": "12.8", "cxx11_abi": True,
            "cuda_available": True, "capabilities": ["9.0"], "sgl_kernel_imported": True}
    return {**base, **values}


Rule = Callable[[abi.Fingerprint], list[abi.AbiProblem]]


def requires(**spec: Any) -> Rule:
    return lambda fp: abi.check_requires("ct200", fp, abi.Requires(**spec))


def stack(fp: abi.Fingerprint) -> list[abi.AbiProblem]:
    return abi.check_host_stack("ct200", fp)


def artifacts(**builds: Any) -> Rule:
    spec = {variant: abi.ArtifactBuild(**build) for variant, build in builds.items()}
    return lambda fp: abi.select_artifacts("ct200", fp, spec).problems


def snapshot_taken_under(then: abi.Fingerprint) -> Rule:
    return lambda now: abi.check_snapshot_compat("ct200", now, then)


# (case, rule, fingerprint, expected [(field, severity)])
CASES: list[tuple[str, Rule, abi.Fingerprint, list[tuple[str, str]]]] = [
    # --- overlay requires vs host
    ("requires: all in range", requires(torch=">=2.11,<2.12", cuda=["cu128", "cu130"], python=">=3.10"),
     fingerprint(), []),
    ("requires: torch local tag ignored", requires(torch="==2.11.0"), cu130(), []),
    ("requires: torch out of range", requires(torch=">=2.11,<2.12"),
     fingerprint(torch_version="2.10.0+cu128"), [("torch", "error")]),
    ("requires: torch not installed", requires(torch=">=2.11"), fingerprint(torch_version=None), [("torch", "error")]),
    ("requires: cu130 overlay on the cu128 host", requires(cuda=["cu130"]), fingerprint(), [("cuda_variant", "error")]),
    ("requires: cuda omitted means any", requires(torch=">=2.11"), cu130(), []),
    ("requires: cpu torch has no CUDA variant", requires(cuda=["cu128", "cu130"]),
     fingerprint(torch_version="2.11.0+cpu", torch_cuda=None), [("cuda_variant", "error")]),
    ("requires: untagged PyPI torch reads torch.version.cuda", requires(cuda=["cu128"]),
     fingerprint(torch_version="2.11.0"), []),
    ("requires: python out of range", requires(python=">=3.12"), fingerprint(), [("python", "error")]),
    ("requires: every failing rule reported", requires(torch=">=2.12", cuda=["cu130"], python=">=3.12"),
     fingerprint(), [("torch", "error"), ("cuda_variant", "error"), ("python", "error")]),
    # --- the host's own stack
    ("stack: consistent cu128 host", stack, fingerprint(), []),
    ("stack: consistent cu130 host", stack, cu130(), []),
    ("stack: sglang pins another torch", stack,
     fingerprint(torch_version="2.10.0+cu128", packages=with_package("torch", "2.10.0+cu128", [])),
     [("sglang.requires.torch", "error"), ("sglang-kernel.requires.torch", "error")]),
    ("stack: sgl-kernel pins another torch", stack,
     fingerprint(packages=with_package("sgl-kernel", "0.3.9", ["torch==2.10.0"])), [("sgl-kernel.requires.torch", "error")]),
    ("stack: sglang pins another kernel", stack,
     fingerprint(packages=with_package("sglang-kernel", "0.4.4", ["torch==2.11.0"])),
     [("sglang.requires.sglang-kernel", "error")]),
    ("stack: pin behind a marker that does not apply", stack,
     fingerprint(packages=with_package("triton", "3.6.0", ['torch==2.9.0; sys_platform == "darwin"'])), []),
    ("stack: pin only for an extra", stack,
     fingerprint(packages=with_package("triton", "3.6.0", ['torch==2.9.0; extra == "tests"'])), []),
    ("stack: pinned dependency missing is a warning", stack,
     fingerprint(packages=with_package("torchvision", "0.26.0", ["torch==2.11.0", "torchaudio==2.11.0"])),
     [("torchvision.requires.torchaudio", "warning")]),
    ("stack: dist-info and version.py disagree", stack, fingerprint(torch_version="2.11.0+cu130", torch_cuda="13.0"),
     [("torch.version", "error"), ("driver_version", "error")]),
    ("stack: PyPI wheel: untagged dist-info, tagged version.py", stack,
     cu130(packages=with_package("torch", "2.11.0", ['triton==3.6.0; platform_system == "Linux"'])),
     [("torch.requires.triton", "warning")]),
    ("stack: host marker environment decides", stack,
     cu130(platform={"platform_system": "Darwin"},
           packages=with_package("torch", "2.11.0", ['triton==3.6.0; platform_system == "Linux"'])), []),
    ("stack: dist-info release differs from version.py", stack,
     fingerprint(packages=with_package("torch", "2.10.0", [])),
     [("sglang.requires.torch", "error"), ("sglang-kernel.requires.torch", "error"), ("torch.version", "error")]),
    ("stack: old-style parenthesised pin", stack,
     fingerprint(packages=with_package("torchvision", "0.26.0", ["torch (==2.11.0)"])), []),
    ("stack: local tag and torch.version.cuda disagree", stack, fingerprint(torch_cuda="13.0", driver_version="580.95.05"),
     [("torch_cuda", "error")]),
    ("stack: cu130 needs an R580 driver", stack, cu130(driver_version="570.124.06"), [("driver_version", "error")]),
    ("stack: cu130 on R580 below the toolkit driver warns", stack, cu130(driver_version="580.10"),
     [("driver_version", "warning")]),
    ("stack: cu128 under minor-version compatibility warns", stack, fingerprint(driver_version="535.104.05"),
     [("driver_version", "warning")]),
    ("stack: cu128 below the 12.x floor", stack, fingerprint(driver_version="520.61.05"), [("driver_version", "error")]),
    ("stack: floor is exact", stack, fingerprint(driver_version="525.60.13"), [("driver_version", "warning")]),
    ("stack: no nvidia-smi, nothing to compare", stack, fingerprint(driver_version=None, gpus=[]), []),
    ("stack: cpu torch ignores the driver", stack,
     fingerprint(torch_version="2.11.0+cpu", torch_cuda=None, driver_version="470.42.01",
                 packages=with_package("torch", "2.11.0+cpu", [])), []),
    ("stack: deep all good", stack, fingerprint(deep=deep()), []),
    ("stack: deep torch import fails", stack,
     fingerprint(deep=deep(torch_imported=False, torch_error="ImportError: libcudart.so.12", torch_version=None,
                           sgl_kernel_imported=False, sgl_kernel_error="ImportError: torch")),
     [("deep.torch", "error"), ("deep.sgl_kernel", "error")]),
    ("stack: deep imports another torch", stack, fingerprint(deep=deep(torch_version="2.9.1+cu126")),
     [("deep.torch_version", "error")]),
    ("stack: deep sees no GPU", stack, fingerprint(deep=deep(cuda_available=False, warnings=["driver too old"])),
     [("deep.cuda_available", "error")]),
    ("stack: deep no GPU expected without nvidia-smi", stack,
     fingerprint(driver_version=None, gpus=[], deep=deep(cuda_available=False)), []),
    ("stack: deep check crashed", stack, fingerprint(deep={"error": "import check killed by SIGSEGV"}),
     [("deep", "error")]),
    # --- compiled artifacts
    ("artifacts: none", artifacts(), fingerprint(), []),
    ("artifacts: build for the host's variant", artifacts(cu128={"torch": "2.11.0"}, cu130={"torch": "2.11.0"}),
     fingerprint(), []),
    ("artifacts: no build for cu128", artifacts(cu130={"torch": "2.11.0"}), fingerprint(), [("artifacts", "error")]),
    ("artifacts: built against another torch", artifacts(cu128={"torch": "2.10.0"}), fingerprint(),
     [("artifacts.cu128.torch", "error")]),
    ("artifacts: cpu host", artifacts(cu128={"torch": "2.11.0"}),
     fingerprint(torch_version="2.11.0+cpu", torch_cuda=None), [("artifacts", "error")]),
    # --- rollback to a snapshot
    ("snapshot: same fingerprint", snapshot_taken_under(fingerprint()), fingerprint(), []),
    ("snapshot: python patch release is the same ABI", snapshot_taken_under(fingerprint(python_version="3.11.4")),
     fingerprint(), []),
    ("snapshot: driver upgrade is not an ABI change", snapshot_taken_under(fingerprint(driver_version="560.35.03")),
     fingerprint(), []),
    ("snapshot: torch moved to cu130", snapshot_taken_under(fingerprint()), cu130(),
     [("torch", "error"), ("cuda_variant", "error")]),
    ("snapshot: python moved to 3.12", snapshot_taken_under(fingerprint()),
     fingerprint(python_version="3.12.1", abi_tag="cp312"), [("python", "error"), ("abi_tag", "error")]),
]


@pytest.mark.parametrize(("rule", "fp", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_rule(rule: Rule, fp: abi.Fingerprint, expected: list[tuple[str, str]]) -> None:
    problems = rule(fp)
    assert [(p.field, p.severity) for p in problems] == expected
    for problem in problems:
        assert problem.host == "ct200" and problem.found and problem.required and problem.message


def test_cu130_overlay_refused_on_cu128_names_both_variants() -> None:
    problems = abi.check_requires("ct200", fingerprint(), abi.Requires(cuda=["cu130"]))
    with pytest.raises(AbiError) as caught:
        abi.raise_problems(problems)
    error = caught.value
    assert (error.code, error.host) == ("abi_mismatch", "ct200")
    assert str(error).startswith("ct200: cuda_variant: ")
    assert "cu130" in str(error) and "cu128" in str(error) and "\n" not in str(error)
    assert error.details["problems"][0]["found"] == "cu128" and error.details["problems"][0]["required"] == "cu130"


def test_raise_problems_reports_every_error_and_keeps_warnings_in_details() -> None:
    problems = [*abi.check_requires("ct200", fingerprint(), abi.Requires(torch=">=2.12", python=">=3.12")),
                *abi.check_host_stack("ct200", fingerprint(driver_version="535.104.05"))]
    with pytest.raises(AbiError) as caught:
        abi.raise_problems(problems, code="preflight_abi", hint="see `ddtree-deploy abi`")
    error = caught.value
    message = str(error)
    assert message.count("ct200") == 1 and "torch: " in message and "python: " in message
    assert ">=2.12" in message and "2.11.0+cu128" in message and ">=3.12" in message and "3.11.7" in message
    assert "driver" not in message  # a warning does not refuse
    assert (error.code, error.hint) == ("preflight_abi", "see `ddtree-deploy abi`")
    assert [p["field"] for p in error.details["problems"]] == ["torch", "python", "driver_version"]


def test_raise_problems_passes_warnings_and_names_each_host() -> None:
    abi.raise_problems([])
    abi.raise_problems(abi.check_host_stack("ct200", fingerprint(driver_version="535.104.05")))
    problems = [*abi.check_requires("ct200", fingerprint(), abi.Requires(cuda=["cu130"])),
                *abi.check_requires("ct129", cu130(), abi.Requires(cuda=["cu128"]))]
    with pytest.raises(AbiError) as caught:
        abi.raise_problems(problems)
    assert caught.value.host is None
    assert str(caught.value).startswith("ct200: cuda_variant") and "; ct129: cuda_variant" in str(caught.value)


def test_select_artifacts_picks_the_host_variant_folder() -> None:
    spec = {"cu128": abi.ArtifactBuild(torch="2.11.0", files=["sgl_kernel/x.so"]),
            "cu130": abi.ArtifactBuild(torch="2.11.0", files=["sgl_kernel/x.so"])}
    assert abi.select_artifacts("ct200", fingerprint(), spec).folder == "files-cu128"
    assert abi.select_artifacts("ct129", cu130(), spec).folder == "files-cu130"
    refused = abi.select_artifacts("ct200", fingerprint(), {"cu130": spec["cu130"]})
    assert refused.folder is None and "cu130" in refused.problems[0].message and "cu128" in refused.problems[0].message


def test_snapshot_differences_are_listed_with_both_values() -> None:
    [torch, variant] = abi.check_snapshot_compat("ct200", cu130(), fingerprint())
    assert (torch.found, torch.required) == ("2.11.0+cu130", "2.11.0+cu128")
    assert (variant.found, variant.required) == ("cu130", "cu128")


@pytest.mark.parametrize("spec", [
    {"torch": "2.11"}, {"python": ">=three"}, {"cuda": ["cuda12"]}, {"cuda": ["cu12.8"]}, {"rocm": ["6.3"]},
])
def test_requires_rejects_bad_manifest_values(spec: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        abi.Requires(**spec)


def test_artifact_build_needs_a_version() -> None:
    with pytest.raises(ValidationError):
        abi.ArtifactBuild(torch="latest")


def test_fingerprint_from_helper() -> None:
    # an old snapshot's copy: fields since dropped are ignored, fields since added take defaults
    old = abi.Fingerprint.from_helper({"python_version": "3.11.7", "torch_version": "2.11.0+cu130", "retired": 1})
    assert (old.cuda_variant, old.cuda_release, old.sglang_version, old.gpus) == ("cu130", "13.0", None, [])
    with pytest.raises(HelperError) as caught:
        abi.Fingerprint.from_helper({"torch_version": "2.11.0"}, host="ct129")
    assert (caught.value.code, caught.value.host) == ("bad_fingerprint", "ct129")
    dumped = fingerprint().model_dump(mode="json")
    assert (dumped["cuda_variant"], dumped["sglang_version"], dumped["kernel_version"]) == ("cu128", "0.5.17", "0.4.5")
    assert abi.Fingerprint.from_helper(dumped) == fingerprint()


@pytest.mark.parametrize(("cuda", "variant"), [("12.8", "cu128"), ("13.0", "cu130"), ("11.8", "cu118"), ("12.10", None)])
def test_variant_names(cuda: str, variant: str | None) -> None:
    assert abi.variant_of_cuda(cuda) == variant
    if variant:
        assert abi.cuda_of_variant(variant) == cuda


def test_driver_table_is_ordered() -> None:
    """A newer CUDA minor never needs an older driver, and each toolkit minimum clears its major's floor."""
    def key(v: str) -> tuple[int, ...]:
        return tuple(int(p) for p in v.split("."))
    minors = sorted(abi.TOOLKIT_DRIVER, key=key)
    drivers = [key(abi.TOOLKIT_DRIVER[m]) for m in minors]
    assert drivers == sorted(drivers)
    for minor in minors:
        assert key(abi.TOOLKIT_DRIVER[minor]) >= key(abi.MINOR_VERSION_COMPAT_FLOOR[int(minor.split(".")[0])])


def test_matrix_flags_differences_and_inconsistent_hosts() -> None:
    columns = [HostColumn(host="ct129", fingerprint=cu130(driver_version="570.124.06")),
               HostColumn(host="ct200", fingerprint=fingerprint()),
               HostColumn(host="ct300", error={"code": "unreachable", "message": "ct300: refused", "hint": ""})]
    matrix = build_matrix(columns)
    rows = {row.field: row for row in matrix.rows}
    assert rows["cuda variant"].values == {"ct129": "cu130", "ct200": "cu128", "ct300": None}
    assert rows["cuda variant"].differs and rows["torch"].differs and rows["torch.version.cuda"].differs
    assert not rows["sglang"].differs and not rows["python"].differs and not rows["driver"].differs
    assert rows["sglang torch pin"].values["ct200"] == "==2.11.0"
    assert "deep: import torch" not in rows  # empty on every host
    assert [p.field for p in matrix.columns[0].problems] == ["driver_version"]
    assert (matrix.columns[0].consistent, matrix.columns[1].consistent, matrix.columns[2].consistent) == (
        False, True, False)
    assert not matrix.consistent
    assert build_matrix(columns[1:2]).consistent


def test_real_h200_fingerprint() -> None:
    """The fingerprint op's answer (with --deep) on a real H200 host with PyPI's torch 2.11.0, recorded once."""
    data = json.loads((Path(__file__).parent / "data" / "h200_fingerprint.json").read_text())
    fp = abi.Fingerprint.from_helper(data, host="h200")
    assert (fp.torch_version, fp.cuda_variant, fp.driver_version) == ("2.11.0+cu130", "cu130", "580.159.04")
    assert fp.deep is not None and fp.deep.cuda_available and fp.deep.capabilities == ["9.0"]
    assert abi.errors_of(abi.check_host_stack("h200", fp)) == []
    spec = {"cu128": abi.ArtifactBuild(torch="2.11.0"), "cu130": abi.ArtifactBuild(torch="2.11.0")}
    assert abi.select_artifacts("h200", fp, spec).folder == "files-cu130"
    [problem] = abi.check_requires("h200", fp, abi.Requires(cuda=["cu128"]))
    assert (problem.found, problem.required) == ("cu130", "cu128")
