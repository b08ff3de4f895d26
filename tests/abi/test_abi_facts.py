"""The helper's `fingerprint` op, run for real through LocalTransport on fake site-packages trees."""

from __future__ import annotations

import ast
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from packaging.tags import sys_tags

from ddtree_deploy import abi
from ddtree_deploy.hostside import facts

FingerprintOf = Callable[..., dict[str, Any]]
H200_OLD_DRIVER = ["NVIDIA H200, 570.86.15, 9.0", "NVIDIA H200, 570.86.15, 9.0"]


def test_cu128_tree_is_read_from_files(make_site: Callable[..., Path], fingerprint_of: FingerprintOf,
                                       no_nvidia_smi: None) -> None:
    site = make_site("2.11.0+cu128", "12.8", dists={
        "sglang-kernel": ("0.4.5", ["torch==2.11.0", "numpy"]),
        "flashinfer-python": ("0.6.15.post1", ["torch>=2.9", "requests"]),
        "triton": ("3.6.0", []),
    })
    fp = abi.Fingerprint.from_helper(fingerprint_of(site))
    assert fp.python_version == platform.python_version()
    assert fp.abi_tag == next(iter(sys_tags())).abi  # packaging computes the same tag independently
    assert fp.package_root == str(site)
    assert (fp.torch_version, fp.torch_cuda, fp.cuda_variant) == ("2.11.0+cu128", "12.8", "cu128")
    assert fp.sglang_version == "0.5.17" and fp.kernel_version == "0.4.5"
    assert fp.flashinfer_version == "0.6.15.post1" and fp.version_of("triton") == "3.6.0"
    # only pins on tracked distributions travel; the long description's "Name:" is not a header
    assert fp.packages["sglang-kernel"].requires == ["torch==2.11.0"]
    assert fp.packages["flashinfer-python"].requires == ["torch>=2.9"]
    assert "torch==2.11.0" in fp.packages["sglang"].requires
    assert fp.packages["sglang"].name == "sglang"
    assert {p.location for p in fp.packages.values()} == {str(site)}
    assert (fp.driver_version, fp.gpus, fp.deep) == (None, [], None)
    # consistent: the only remark is torchaudio, pinned by sglang but absent from this tree
    assert [(p.field, p.severity) for p in abi.check_host_stack("ct200", fp)] == [
        ("sglang.requires.torchaudio", "warning")]


@pytest.mark.parametrize(("torch", "cuda", "variant", "label"), [
    ("2.11.0+cu130", "13.0", "cu130", "cu130"),
    ("2.11.0+cpu", None, None, "cpu"),
    ("2.11.0", "12.8", "cu128", "cu128"),  # PyPI's untagged default wheel: the variant comes from torch.version.cuda
])
def test_torch_variants(make_site: Callable[..., Path], fingerprint_of: FingerprintOf, no_nvidia_smi: None,
                        torch: str, cuda: str | None, variant: str | None, label: str) -> None:
    fp = abi.Fingerprint.from_helper(fingerprint_of(make_site(torch, cuda)))
    assert (fp.torch_version, fp.torch_cuda, fp.cuda_variant, fp.variant_label) == (torch, cuda, variant, label)


def test_pypi_wheel_layout_as_on_the_h200_box(make_site: Callable[..., Path], fingerprint_of: FingerprintOf,
                                             nvidia_smi: Callable[..., Path]) -> None:
    """What the real fingerprint op read on an H200 host: torch from PyPI, dist-info 2.11.0, version.py +cu130."""
    nvidia_smi(["NVIDIA H200, 580.159.04, 9.0"])
    fp = abi.Fingerprint.from_helper(fingerprint_of(make_site("2.11.0+cu130", "13.0", torch_dist="2.11.0")))
    assert (fp.version_of("torch"), fp.torch_version, fp.cuda_variant) == ("2.11.0", "2.11.0+cu130", "cu130")
    assert abi.errors_of(abi.check_host_stack("h200", fp)) == []
    assert abi.check_requires("h200", fp, abi.Requires(torch="==2.11.0", cuda=["cu130"])) == []


def test_nvidia_smi_on_path_reports_driver_too_old_for_cu130(
        make_site: Callable[..., Path], fingerprint_of: FingerprintOf, nvidia_smi: Callable[..., Path]) -> None:
    nvidia_smi(H200_OLD_DRIVER)
    ct129 = abi.Fingerprint.from_helper(fingerprint_of(make_site("2.11.0+cu130", "13.0")))
    assert ct129.driver_version == "570.86.15"
    assert [(g.name, g.compute_cap) for g in ct129.gpus] == [("NVIDIA H200", "9.0")] * 2
    [problem] = abi.errors_of(abi.check_host_stack("ct129", ct129))
    assert (problem.field, problem.found, problem.required, problem.severity) == (
        "driver_version", "570.86.15", ">=580", "error")
    # the same driver runs the cu128 build
    ct200 = abi.Fingerprint.from_helper(fingerprint_of(make_site("2.11.0+cu128", "12.8")))
    assert abi.errors_of(abi.check_host_stack("ct200", ct200)) == []


def test_explicit_nvidia_smi_path_and_failing_smi(make_site: Callable[..., Path], fingerprint_of: FingerprintOf,
                                                  nvidia_smi: Callable[..., Path], no_nvidia_smi: None) -> None:
    script = nvidia_smi(["NVIDIA H200, 580.95.05, 9.0"], on_path=False)
    site = make_site()
    assert fingerprint_of(site)["driver_version"] is None
    assert fingerprint_of(site, nvidia_smi=str(script))["driver_version"] == "580.95.05"
    broken = nvidia_smi(["NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."], code=9,
                        on_path=False)
    data = fingerprint_of(site, nvidia_smi=str(broken))
    assert data["driver_version"] is None and data["gpus"] == []
    assert "exited 9" in str(data["nvidia_smi_error"]) and "couldn't communicate" in str(data["nvidia_smi_error"])


def test_kernel_pinning_another_torch_is_caught(make_site: Callable[..., Path], fingerprint_of: FingerprintOf,
                                               no_nvidia_smi: None) -> None:
    site = make_site("2.11.0+cu128", "12.8", dists={"sgl-kernel": ("0.3.9", ["torch==2.10.0"])})
    fp = abi.Fingerprint.from_helper(fingerprint_of(site))
    errors = abi.errors_of(abi.check_host_stack("ct200", fp))
    assert [(p.field, p.found, p.required) for p in errors] == [("sgl-kernel.requires.torch", "2.11.0+cu128", "==2.10.0")]


def test_deep_reports_failed_imports_without_failing(make_site: Callable[..., Path], fingerprint_of: FingerprintOf,
                                                     no_nvidia_smi: None) -> None:
    site = make_site("2.11.0+cu130", "13.0", dists={"sglang-kernel": ("0.4.5", ["torch==2.11.0"])})
    (site / "torch" / "__init__.py").write_text(
        "print('noise on stdout from a native import')\n"
        "raise ImportError('libcudart.so.13: cannot open shared object file: No such file or directory')\n")
    fp = abi.Fingerprint.from_helper(fingerprint_of(site, deep=True))
    assert fp.deep is not None and fp.deep.error is None
    assert not fp.deep.torch_imported and "libcudart.so.13" in str(fp.deep.torch_error)
    assert fp.deep.sgl_kernel_imported is False
    fields = {p.field for p in abi.check_host_stack("ct129", fp)}
    assert {"deep.torch", "deep.sgl_kernel"} <= fields


def test_deep_survives_a_crashing_import(make_site: Callable[..., Path], fingerprint_of: FingerprintOf,
                                         no_nvidia_smi: None) -> None:
    site = make_site()
    (site / "torch" / "__init__.py").write_text("import os\nos.abort()\n")
    fp = abi.Fingerprint.from_helper(fingerprint_of(site, deep=True))
    assert fp.deep is not None and fp.deep.error is not None
    assert "killed by SIGABRT" in fp.deep.error and "without an answer" in fp.deep.error
    assert [p.field for p in abi.errors_of(abi.check_host_stack("ct200", fp))] == ["deep"]


def test_deep_imports_the_real_torch(make_site: Callable[..., Path], fingerprint_of: FingerprintOf,
                                     no_nvidia_smi: None) -> None:
    """No fake torch in the tree: the environment's real torch is found on sys.path and really imported."""
    import torch

    site = make_site(torch=None)
    (site / "sgl_kernel").mkdir()
    (site / "sgl_kernel" / "__init__.py").write_text(
        "raise ImportError('undefined symbol: _ZN3c1017RegisterOperatorsD1Ev')\n")
    fp = abi.Fingerprint.from_helper(fingerprint_of(site, deep=True))
    assert fp.torch_version == torch.__version__ and fp.packages["torch"].location != str(site)
    assert fp.deep is not None and fp.deep.torch_imported
    assert fp.deep.torch_version == torch.__version__
    assert fp.deep.cxx11_abi == torch.compiled_with_cxx11_abi()
    assert fp.deep.cuda_available == torch.cuda.is_available()
    assert fp.deep.sgl_kernel_imported is False and "undefined symbol" in str(fp.deep.sgl_kernel_error)


@pytest.mark.parametrize(("damage", "why"), [
    (lambda path: path.unlink(), "FileNotFoundError"),
    (lambda path: path.write_text("__version__ = '2.11.0+cu1"), "SyntaxError"),
    (lambda path: path.write_text("__version__ = compute()\n"), "no literal __version__"),
])
def test_damaged_torch_version_py_is_reported(make_site: Callable[..., Path], fingerprint_of: FingerprintOf,
                                             no_nvidia_smi: None, damage: Callable[[Path], None], why: str) -> None:
    site = make_site("2.11.0+cu128", "12.8")
    damage(site / "torch" / "version.py")
    fp = abi.Fingerprint.from_helper(fingerprint_of(site))
    assert fp.torch_version == "2.11.0+cu128" and fp.torch_cuda is None  # the dist-info's version stands in
    assert why in str(fp.torch_version_error)
    [problem] = abi.errors_of(abi.check_host_stack("ct200", fp))
    assert problem.field == "torch.version" and why in problem.message


def test_torch_version_py_is_parsed_not_executed(tmp_path: Path) -> None:
    path = tmp_path / "version.py"
    path.write_text("import sys\nsys.exit('executed!')\n__version__ = '2.11.0+cu130'\n"
                    "cuda: 'Optional[str]' = '13.0'\nhip = None\nx = f()\n")
    assert facts.read_torch_version(str(path)) == {"__version__": "2.11.0+cu130", "cuda": "13.0", "hip": None}


def test_helper_module_is_stdlib_only_and_python38_syntax() -> None:
    source = Path(facts.__file__).read_text()
    tree = ast.parse(source, feature_version=(3, 8))
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module and node.level == 0}
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}
    ast.parse(facts.DEEP_PROBE, feature_version=(3, 8))


def test_metadata_headers_read_as_the_email_parser_reads_them() -> None:
    """The helper reads METADATA headers by hand (email's imports cost ~30 ms per helper start): same answers,
    for every installed distribution of this python and for the folds a licence text makes."""
    import email.parser
    import importlib.metadata

    tricky = ("Metadata-Version: 2.4\nName: tricky\nLicense: BSD\n        \n        - Copyright\n"
              "Version: 1.2\nRequires-Dist: torch==2.11.0\nRequires-Dist: numpy ;\n  extra == 'x'\n\n"
              "Name: not-a-header\nRequires-Dist: nor-this\n")
    texts = [tricky] + [d.read_text("METADATA") or "" for d in importlib.metadata.distributions()]
    assert len(texts) > 20
    for text in texts:
        want = email.parser.HeaderParser().parsestr(text)
        got = facts.metadata_headers(text.splitlines(keepends=True))
        for key in ("Name", "Version", "Requires-Dist"):
            assert got.get(key.lower(), []) == [" ".join(v.split()) for v in want.get_all(key) or []], (key, text[:80])
