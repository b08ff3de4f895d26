"""The `fingerprint` op: what a host's python environment is, read from files without importing it.

Everything comes from the interpreter itself, the packages' `*.dist-info/METADATA`, `torch/version.py`
(parsed with `ast`, never imported: importing torch takes seconds and can crash) and `nvidia-smi`
when it is on PATH. `deep` adds one real import of torch and sgl_kernel in a child process, since
metadata can lie; its failures are reported, never raised.
"""

from __future__ import annotations

import ast
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple

from .common import Context

#: distributions whose versions and mutual pins decide whether the sglang stack can import
#: (canonical PEP 503 names; sglang-kernel is the current name of sgl-kernel, flashinfer-python of flashinfer)
TRACKED = (
    "sglang", "torch", "sglang-kernel", "sgl-kernel", "flashinfer-python", "flashinfer",
    "triton", "torchvision", "torchaudio",
)
NVIDIA_SMI_QUERY = ["--query-gpu=name,driver_version,compute_cap", "--format=csv,noheader"]
DEEP_MARKER = "@@ddtree-deep@@"

# Runs in a child of the host's python; prints one marked JSON line last, since importing native
# extensions may print to stdout on their own.
DEEP_PROBE = r"""
import json, sys, warnings
sys.path.insert(0, sys.argv[1])
out = {"torch_imported": False}
def why(exc):
    return "%s: %s" % (type(exc).__name__, exc)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
        import torch
        out["torch_imported"] = True
        out["torch_version"] = str(torch.__version__)
        out["torch_cuda"] = torch.version.cuda
        out["cxx11_abi"] = bool(torch.compiled_with_cxx11_abi())
        out["cuda_available"] = bool(torch.cuda.is_available())
        out["capabilities"] = ["%d.%d" % torch.cuda.get_device_capability(i)
                               for i in range(torch.cuda.device_count())] if out["cuda_available"] else []
    except (Exception, SystemExit) as exc:
        out["torch_error"] = why(exc)
    try:
        import sgl_kernel
        out["sgl_kernel_imported"] = True
    except (Exception, SystemExit) as exc:
        out["sgl_kernel_imported"] = False
        out["sgl_kernel_error"] = why(exc)
    out["warnings"] = [str(w.message) for w in caught]
sys.stdout.write("\n" + sys.argv[2] + json.dumps(out) + "\n")
"""


def fingerprint(ctx: Context, args: Dict[str, Any]) -> Dict[str, Any]:
    """Describe this environment: python, packages and their pins, torch build, driver and GPUs.

    + deep: also import torch and sgl_kernel in a child process (slow; seconds)
    + nvidia_smi: path of nvidia-smi to use instead of the one on PATH
    + deep_timeout_s: how long the import check may take (default 180)
    """
    packages = installed_packages(search_path(ctx.package_root))
    smi = args.get("nvidia_smi") or shutil.which("nvidia-smi")
    driver, gpus, smi_error = query_gpus(smi) if smi else (None, [], None)
    data = dict(python_facts(), package_root=ctx.package_root, packages=packages, **torch_build(packages.get("torch")),
                nvidia_smi=smi, driver_version=driver, gpus=gpus, nvidia_smi_error=smi_error, deep=None)
    if args.get("deep"):
        data["deep"] = deep_check(ctx.package_root, float(args.get("deep_timeout_s", 180)))
    return data


def python_facts() -> Dict[str, Any]:
    return {
        "python_version": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "python_executable": os.path.realpath(sys.executable),
        "python_prefix": sys.prefix,
        "abi_tag": abi_tag(),
        "soabi": sysconfig.get_config_var("SOABI"),
        "platform": marker_environment(),
    }


def abi_tag() -> str:
    """The wheel ABI tag of this interpreter (cp311, cp313t, ...), as packaging.tags computes it."""
    if sys.implementation.name == "cpython":
        debug = "d" if sysconfig.get_config_var("Py_DEBUG") else ""
        threaded = "t" if sysconfig.get_config_var("Py_GIL_DISABLED") else ""
        return f"cp{sys.version_info[0]}{sys.version_info[1]}{threaded}{debug}"
    return str(sys.implementation.cache_tag).replace("-", "_").replace(".", "_")


def marker_environment() -> Dict[str, str]:
    """PEP 508 marker values of this host, so the controller evaluates Requires-Dist markers as the host would."""
    impl = sys.implementation.version
    impl_version = f"{impl.major}.{impl.minor}.{impl.micro}"
    if impl.releaselevel != "final":
        impl_version += impl.releaselevel[0] + str(impl.serial)
    return {
        "implementation_name": sys.implementation.name,
        "implementation_version": impl_version,
        "os_name": os.name,
        "platform_machine": platform.machine(),
        "platform_release": platform.release(),
        "platform_system": platform.system(),
        "platform_version": platform.version(),
        "python_full_version": platform.python_version(),
        "platform_python_implementation": platform.python_implementation(),
        "python_version": f"{sys.version_info[0]}.{sys.version_info[1]}",
        "sys_platform": sys.platform,
    }


def canonical_name(name: str) -> str:
    """PEP 503 normalisation: `Flashinfer_Python` and `flashinfer.python` are `flashinfer-python`."""
    return re.sub(r"[-_.]+", "-", name).lower()


def search_path(package_root: str) -> List[str]:
    """The package root first, then this python's sys.path: where the server's imports would look."""
    seen: Set[str] = set()
    out: List[str] = []
    for entry in [package_root] + sys.path:
        real = os.path.realpath(entry) if entry else ""
        if real and real not in seen and os.path.isdir(real):
            seen.add(real)
            out.append(entry)
    return out


def installed_packages(folders: List[str]) -> Dict[str, Dict[str, Any]]:
    """For each tracked distribution, the first one found along `folders`: version, folder, tracked pins."""
    found: Dict[str, Dict[str, Any]] = {}
    for folder in folders:
        try:
            entries = sorted(os.listdir(folder))
        except OSError:  # an unreadable sys.path entry hides nothing the server could import either
            continue
        for entry in entries:
            if not entry.endswith(".dist-info"):
                continue
            name = canonical_name(entry[: -len(".dist-info")].split("-", 1)[0])
            if name in TRACKED and name not in found:
                meta = read_metadata(os.path.join(folder, entry, "METADATA"))
                if meta is not None:
                    found[name] = dict(meta, location=folder)
    return found


def read_metadata(path: str) -> Optional[Dict[str, Any]]:
    """Name, version and the Requires-Dist lines that name a tracked distribution (None if unreadable)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            headers = metadata_headers(f)
    except OSError:
        return None
    requires = [line for line in headers.get("requires-dist", []) if requirement_name(line) in TRACKED]
    return {"name": first(headers, "name"), "version": first(headers, "version"), "requires": requires}


def metadata_headers(lines: Iterable[str]) -> Dict[str, List[str]]:
    """The header block of a core-metadata file (RFC 822 style): lower-cased name -> its values in order.

    Read by hand rather than with `email.parser`, whose imports cost ~30 ms of every helper start;
    the block ends at the first blank line (the description follows), folded lines are joined.
    """
    headers: Dict[str, List[str]] = {}
    values: Optional[List[str]] = None
    for line in lines:
        if not line.rstrip("\r\n"):
            break  # a blank line; one of spaces only is a folded line (licence texts have them)
        if line[0] in " \t":
            if values:
                values[-1] += " " + line.strip()
            continue
        name, colon, value = line.partition(":")
        if not colon:
            break  # not a header: the block is over, as for email's parser
        values = headers.setdefault(name.strip().lower(), [])
        values.append(value.strip())
    return headers


def first(headers: Dict[str, List[str]], name: str) -> Optional[str]:
    values = headers.get(name)
    return values[0] if values else None


def requirement_name(line: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", line)
    return canonical_name(match.group(1)) if match else ""


def torch_build(torch: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """torch's version (local tag included) and CUDA/HIP release from torch/version.py beside its dist-info.

    If version.py is missing or unreadable, the dist-info's version stands in and `torch_version_error` says why.
    """
    build: Dict[str, Any] = {"torch_version": None, "torch_cuda": None, "torch_hip": None,
                             "torch_version_file": None, "torch_version_error": None}
    if not torch:
        return build
    path = os.path.join(torch["location"], "torch", "version.py")
    build["torch_version_file"] = path
    try:
        values = read_torch_version(path)
    except (OSError, SyntaxError, ValueError) as exc:
        values = {}
        build["torch_version_error"] = f"{path}: {type(exc).__name__}: {exc}"
    if "__version__" not in values and not build["torch_version_error"]:
        build["torch_version_error"] = f"{path} sets no literal __version__"
    build.update(torch_version=values.get("__version__") or torch.get("version"), torch_cuda=values.get("cuda"),
                 torch_hip=values.get("hip"))
    return build


def read_torch_version(path: str) -> Dict[str, Any]:
    """The literal assignments of torch/version.py (`__version__`, `cuda`, `hip`, ...), never executed."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    values: Dict[str, Any] = {}
    for node in tree.body:
        target, value = _assignment(node)
        if target is None or value is None:
            continue
        try:
            values[target] = ast.literal_eval(value)
        except ValueError:  # not a literal (an expression computed at import): leave it out
            continue
    return values


def _assignment(node: ast.stmt) -> Tuple[Optional[str], Optional[ast.expr]]:
    # torch writes both `cuda = '12.8'` and `cuda: Optional[str] = '12.8'`
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
        return node.targets[0].id, node.value
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return node.target.id, node.value
    return None, None


def query_gpus(smi: str) -> Tuple[Optional[str], List[Dict[str, Optional[str]]], Optional[str]]:
    """Driver version, GPUs (name, compute capability) and an error message from nvidia-smi."""
    try:
        proc = subprocess.run([smi] + NVIDIA_SMI_QUERY, capture_output=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, [], f"{smi}: {exc}"
    text = proc.stdout.decode(errors="replace")
    if proc.returncode != 0:
        tail = (proc.stderr.decode(errors="replace") + text).strip().splitlines()[-1:] or ["no output"]
        return None, [], f"{smi} exited {proc.returncode}: {tail[0]}"
    gpus, drivers = [], []
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.split(",")]
        if len(cells) != 3:
            continue
        name, driver, cap = cells
        drivers.append(driver)
        gpus.append({"name": name, "compute_cap": cap if re.match(r"^\d+\.\d+$", cap) else None})
    if not gpus:
        return None, [], f"{smi} printed no GPU lines"
    return drivers[0], gpus, None


def deep_check(package_root: str, timeout_s: float) -> Dict[str, Any]:
    """Import torch and sgl_kernel in a child python; a crash, a hang or garbage becomes `error`."""
    argv = [sys.executable, "-c", DEEP_PROBE, package_root, DEEP_MARKER]
    try:
        proc = subprocess.run(argv, capture_output=True, timeout=timeout_s, cwd="/", check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"import check did not finish within {timeout_s:g}s"}
    for line in reversed(proc.stdout.decode(errors="replace").splitlines()):
        if line.startswith(DEEP_MARKER):
            answer: Dict[str, Any] = json.loads(line[len(DEEP_MARKER):])
            return answer
    tail = " | ".join(proc.stderr.decode(errors="replace").strip().splitlines()[-3:])
    return {"error": f"import check {_exit_status(proc.returncode)} without an answer: {tail or 'no output'}"}


def _exit_status(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited {code}"


OPS = {"fingerprint": fingerprint}
