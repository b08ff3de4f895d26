"""Simulated GPU hosts: a folder tree per host with its own python environment holding the real sglang release.

A host tree looks like this (the root may contain spaces, quotes or `$(...)`; nothing here passes a
path through a shell):

    <root>/env/                 a venv of this machine's python (`python3 -m venv --without-pip`)
    <root>/env/lib/pythonX.Y/site-packages/
        sglang/, sglang-0.5.17.dist-info/      the REAL release files, exactly as `pip install` left them
        torch/version.py, torch-<v>.dist-info/ torch metadata for the profile's CUDA variant (no real torch)
        sgl_kernel/, sglang_kernel-<v>.dist-info/, flashinfer/, flashinfer_python-<v>.dist-info/
    <root>/bin/nvidia-smi       a stand-in answering the queries nvidia-smi answers (optional)
    <root>/state/               the state base the inventory points at, so hosts never share state
    <root>/home/                the host's home directory (separate machines have separate homes)

The release is fetched once with `pip download --no-deps sglang==<v>` into
`~/.cache/ddtree-deploy/releases/`, installed once with pip into an image folder beside it (so the
image holds what pip really writes: dist-info with INSTALLER, REQUESTED and RECORD), then copied whole
into every host: hosts share no inode, so one host's change never shows on another. The image is
installed with `--no-compile`: no `__pycache__` halves what each host copies (80 MB, 4.3k files);
a real host has them, and the store ignores them either way.
The torch/kernel packages are stand-ins (their `__init__` refuses to import); only metadata is real-shaped.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

SGLANG_VERSION = "0.5.17"
CACHE_ENV = "DDTREE_DEPLOY_CACHE"

# Stand-in packages must never be mistaken for the real thing if something imports them.
_STUB_INIT = 'raise ImportError("{name} is a ddtree-deploy sandbox stand-in (metadata only, no binaries)")\n'


class Gpu(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    compute_cap: str
    memory_mib: int
    uuid: str


class HostProfile(BaseModel):
    """What distinguishes one simulated host: its torch build, kernel wheels, driver and GPUs."""

    model_config = ConfigDict(frozen=True)

    name: str
    torch_version: str = Field(description="with its local tag, e.g. 2.11.0+cu130")
    torch_cuda: str = Field(description="torch.version.cuda, e.g. 13.0")
    torch_git: str
    torch_requires: tuple[str, ...] = Field(description="Requires-Dist lines of the torch build")
    sglang_kernel_version: str
    flashinfer_version: str
    flashinfer_extra: str = Field(description="the CUDA extra of flashinfer-python, e.g. cu13")
    driver_version: str
    driver_cuda: str = Field(description="the CUDA version nvidia-smi's banner shows")
    gpus: tuple[Gpu, ...]


def _nvidia_pins(suffix: str, pins: dict[str, str]) -> tuple[str, ...]:
    linux = '; platform_system == "Linux"'
    return tuple(f"{name}{suffix}=={version}{linux}" for name, version in pins.items())


_TORCH_COMMON = (
    "filelock", "typing-extensions>=4.10.0", "setuptools", "sympy>=1.13.3", "networkx>=2.5.1", "jinja2",
    "fsspec>=0.8.5",
)
# Pins shaped like the real torch 2.11.0 wheels' (only their shape and suffixes matter to the tools).
_CU130 = _nvidia_pins("", {
    "nvidia-cuda-nvrtc": "13.0.88", "nvidia-cuda-runtime": "13.0.96", "nvidia-cuda-cupti": "13.0.85",
    "nvidia-cublas": "13.1.0.3", "nvidia-cufft": "12.0.0.61", "nvidia-curand": "10.4.0.35",
    "nvidia-cusolver": "12.0.4.66", "nvidia-cusparse": "12.6.3.3", "nvidia-nvtx": "13.0.85",
    "nvidia-nvjitlink": "13.0.88", "nvidia-cufile": "1.15.1.6",
}) + _nvidia_pins("-cu13", {"nvidia-cudnn": "9.15.1.9", "nvidia-cusparselt": "0.8.0", "nvidia-nccl": "2.28.9",
                            "nvidia-nvshmem": "3.4.5"})
_CU128 = _nvidia_pins("-cu12", {
    "nvidia-cuda-nvrtc": "12.8.93", "nvidia-cuda-runtime": "12.8.90", "nvidia-cuda-cupti": "12.8.90",
    "nvidia-cudnn": "9.10.2.21", "nvidia-cublas": "12.8.4.1", "nvidia-cufft": "11.3.3.83",
    "nvidia-curand": "10.3.9.90", "nvidia-cusolver": "11.7.3.90", "nvidia-cusparse": "12.5.8.93",
    "nvidia-cusparselt": "0.7.1", "nvidia-nccl": "2.27.5", "nvidia-nvshmem": "3.3.20", "nvidia-nvtx": "12.8.90",
    "nvidia-nvjitlink": "12.8.93", "nvidia-cufile": "1.13.1.3",
})
_TRITON = ('triton==3.6.0; platform_system == "Linux"',)

PROFILES: dict[str, HostProfile] = {
    "ct129": HostProfile(
        name="ct129", torch_version="2.11.0+cu130", torch_cuda="13.0",
        torch_git="70d99e998b2a2ad6ee9de1b51a3f4a7ba5bbd0e3", torch_requires=_TORCH_COMMON + _CU130 + _TRITON,
        sglang_kernel_version="0.4.5", flashinfer_version="0.6.15.post1", flashinfer_extra="cu13",
        driver_version="580.95.05", driver_cuda="13.0",
        gpus=(Gpu(name="NVIDIA H200", compute_cap="9.0", memory_mib=143771,
                  uuid="GPU-5f3a1c2e-8b7d-4e61-9a0f-2c4d6e8f1a3b"),),
    ),
    "ct200": HostProfile(
        name="ct200", torch_version="2.11.0+cu128", torch_cuda="12.8",
        torch_git="70d99e998b2a2ad6ee9de1b51a3f4a7ba5bbd0e3", torch_requires=_TORCH_COMMON + _CU128 + _TRITON,
        sglang_kernel_version="0.4.5+cu128", flashinfer_version="0.6.15.post1", flashinfer_extra="cu12",
        driver_version="570.172.08", driver_cuda="12.8",
        gpus=(Gpu(name="NVIDIA H100 80GB HBM3", compute_cap="9.0", memory_mib=81559,
                  uuid="GPU-0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0"),
              Gpu(name="NVIDIA H100 80GB HBM3", compute_cap="9.0", memory_mib=81559,
                  uuid="GPU-9e8d7c6b-5a49-3827-1605-f4e3d2c1b0a9")),
    ),
}


class SandboxHost(BaseModel):
    """A built host tree: where its python, package root, tools and state live."""

    name: str
    profile: str
    root: Path
    python: Path = Field(description="the environment's python (a venv symlink to this machine's python)")
    package_root: Path = Field(description="site-packages folder holding sglang/")
    bin_dir: Path = Field(description="machine tools (nvidia-smi); put it first on PATH")
    state_dir: Path = Field(description="state base for the inventory's state_dir")
    home: Path = Field(description="the host's home directory")

    def env(self) -> dict[str, str]:
        """This process's environment as seen on the host: its home, and its tools first on PATH."""
        return {**os.environ, "HOME": str(self.home),
                "PATH": f"{self.bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}

    def digest(self) -> str:
        """A digest of every path's name, type, mode, size and mtime under the root: any write changes it."""
        h = hashlib.sha256()
        for folder, dirs, files in os.walk(self.root):
            dirs.sort()
            for entry in sorted(dirs + files):
                st = os.lstat(os.path.join(folder, entry))
                h.update(f"{folder}/{entry}\0{st.st_mode}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        return h.hexdigest()

    def inventory_entry(self, **extra: object) -> dict[str, object]:
        """The host's keys for inventory.yaml (python, package_root, state_dir), plus `extra`."""
        return {"python": str(self.python), "package_root": str(self.package_root),
                "state_dir": str(self.state_dir), **extra}


def package_files(package_root: Path) -> Iterator[Path]:
    """Every file of sglang/ and its dist-info under `package_root`, in a stable order, bytecode caches aside:
    what a snapshot covers, and what tests and benchmarks compare."""
    for top in sorted(p for p in package_root.iterdir() if p.name == "sglang" or p.name.startswith("sglang-")):
        for folder, dirs, files in os.walk(top):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(files):
                yield Path(folder, name)


def cache_dir() -> Path:
    """`$DDTREE_DEPLOY_CACHE`, else `$XDG_CACHE_HOME/ddtree-deploy`, else `~/.cache/ddtree-deploy`."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ddtree-deploy"


def build_host(root: Path, profile: str, *, name: str | None = None, sglang_version: str = SGLANG_VERSION,
               nvidia_smi: bool = True) -> SandboxHost:
    """Build a host tree at `root` (which must not exist or be empty) for one of `PROFILES`.

    Args:
        root: folder of the new host; any characters allowed.
        profile: `ct129` (torch cu130) or `ct200` (torch cu128).
        name: host name (default: the profile's).
        sglang_version: the sglang release installed into site-packages.
        nvidia_smi: also install the nvidia-smi stand-in in `<root>/bin`.
    Returns:
        The host's paths.
    Raises:
        KeyError: unknown profile. FileExistsError: `root` is not empty.
        subprocess.CalledProcessError: pip or venv failed.
    """
    spec = PROFILES[profile]
    root = Path(root).absolute()
    if root.exists() and any(root.iterdir()):
        raise FileExistsError(f"{root}: host root is not empty")
    image = release_image(sglang_version)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "env")], check=True,
                   capture_output=True)
    python = root / "env" / "bin" / "python3"
    site = _site_packages(root / "env")
    _copy_tree(image / "site-packages", site)
    _install_scripts(image / "bin", root / "env" / "bin", python)
    _write_torch(site, spec)
    _write_kernels(site, spec)
    bin_dir = root / "bin"
    bin_dir.mkdir()
    if nvidia_smi:
        _write_executable(bin_dir / "nvidia-smi", nvidia_smi_script(spec))
    (root / "state").mkdir()
    (root / "home").mkdir()
    return SandboxHost(name=name or profile, profile=profile, root=root, python=python, package_root=site,
                       bin_dir=bin_dir, state_dir=root / "state", home=root / "home")


def release_image(version: str = SGLANG_VERSION) -> Path:
    """The cached image of `pip install --no-deps sglang==<version>` for this python: site-packages/ and bin/.

    Built once per (version, python) under a file lock, so concurrent test runs share it safely.
    """
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    image = cache_dir() / "images" / f"sglang-{version}-{tag}-nocompile"
    if image.is_dir():
        return image
    with _cache_lock():
        if image.is_dir():  # another run built it while we waited
            return image
        wheel = release_wheel(version)
        staging = Path(tempfile.mkdtemp(prefix=".building-", dir=image.parent))
        try:
            # pip itself installs, so the image is byte for byte what a host's pip install leaves
            subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                            "--no-warn-script-location", "--disable-pip-version-check", "--no-compile",
                            "--prefix", str(staging / "prefix"), str(wheel)],
                           check=True, capture_output=True)
            site = _site_packages(staging / "prefix")
            # pip records the local file it installed from; a host installed from the index has no such file
            for direct_url in site.glob("*.dist-info/direct_url.json"):
                direct_url.unlink()
            site.rename(staging / "site-packages")
            (staging / "prefix" / "bin").rename(staging / "bin")
            shutil.rmtree(staging / "prefix")
            staging.rename(image)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return image


def release_wheel(version: str = SGLANG_VERSION) -> Path:
    """The sglang wheel for this python, downloaded once into the cache with `pip download --no-deps`."""
    releases = cache_dir() / "releases"
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    found = sorted(releases.glob(f"sglang-{version}-{tag}-*.whl")) + sorted(
        releases.glob(f"sglang-{version}-py3-*.whl"))
    if found:
        return found[0]
    releases.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=releases) as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                        "--disable-pip-version-check", "-d", tmp, f"sglang=={version}"],
                       check=True, capture_output=True)
        wheel = next(Path(tmp).glob("sglang-*.whl"))
        return wheel.rename(releases / wheel.name)


@contextlib.contextmanager
def _cache_lock() -> Iterator[None]:
    folder = cache_dir() / "images"
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _site_packages(prefix: Path) -> Path:
    relative = Path(sysconfig.get_path("purelib", vars={"base": "", "platbase": ""}).lstrip("/"))
    site = prefix / relative
    site.mkdir(parents=True, exist_ok=True)
    return site


def _copy_tree(source: Path, target: Path) -> None:
    """Copy every file (no hard links: hosts must not share inodes); `cp -a` is several times faster than copytree."""
    subprocess.run(["cp", "-a", "--reflink=auto", "--", f"{source}/.", str(target)], check=True,
                   capture_output=True)


def _install_scripts(source: Path, target: Path, python: Path) -> None:
    """Console scripts point at the host's python, as pip would have written them."""
    for script in source.iterdir():
        body = script.read_text().split("\n", 1)[1]
        _write_executable(target / script.name, f"#!{python}\n{body}")


def _write_executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


def _write_torch(site: Path, spec: HostProfile) -> None:
    version_py = (
        "from typing import Optional\n\n"
        "__all__ = ['__version__', 'debug', 'cuda', 'git_version', 'hip', 'rocm', 'xpu']\n"
        f"__version__ = '{spec.torch_version}'\n"
        "debug = False\n"
        f"cuda: Optional[str] = '{spec.torch_cuda}'\n"
        f"git_version = '{spec.torch_git}'\n"
        "hip: Optional[str] = None\n"
        "rocm: Optional[str] = None\n"
        "xpu: Optional[str] = None\n"
    )
    metadata = [
        "Summary: Tensors and Dynamic neural networks in Python with strong GPU acceleration",
        "Author-email: PyTorch Team <packages@pytorch.org>",
        "Requires-Python: >=3.10",
        *(f"Requires-Dist: {req}" for req in spec.torch_requires),
        "Provides-Extra: optree",
        'Requires-Dist: optree>=0.13.0; extra == "optree"',
    ]
    files = {"torch/__init__.py": _STUB_INIT.format(name="torch"), "torch/version.py": version_py}
    _write_distribution(site, "torch", spec.torch_version, files, metadata)


def _write_kernels(site: Path, spec: HostProfile) -> None:
    base_torch = spec.torch_version.split("+")[0]
    _write_distribution(
        site, "sglang-kernel", spec.sglang_kernel_version,
        {"sgl_kernel/__init__.py": _STUB_INIT.format(name="sgl_kernel"),
         "sgl_kernel/version.py": f'__version__ = "{spec.sglang_kernel_version}"\n'},
        ["Summary: Kernel Library for SGLang", "Requires-Python: >=3.10", f"Requires-Dist: torch=={base_torch}"],
    )
    extra = spec.flashinfer_extra
    _write_distribution(
        site, "flashinfer-python", spec.flashinfer_version,
        {"flashinfer/__init__.py": _STUB_INIT.format(name="flashinfer"),
         "flashinfer/_build_meta.py": f'__version__ = "{spec.flashinfer_version}"\n'},
        ["Summary: FlashInfer: Kernel Library for LLM Serving", "Requires-Python: >=3.10",
         "Requires-Dist: apache-tvm-ffi<0.2,>=0.1.6", "Requires-Dist: ninja", "Requires-Dist: numpy",
         f"Requires-Dist: torch>={base_torch}", f"Provides-Extra: {extra}",
         f'Requires-Dist: nvidia-cudnn-frontend>=1.13.0; extra == "{extra}"'],
    )


def _write_distribution(site: Path, name: str, version: str, files: dict[str, str], metadata: list[str]) -> None:
    """Write package files and a pip-shaped dist-info (METADATA, WHEEL, INSTALLER, top_level, RECORD)."""
    dist_info = f"{name.replace('-', '_')}-{version}.dist-info"
    top_level = sorted({path.split("/")[0] for path in files})
    meta = "\n".join(["Metadata-Version: 2.4", f"Name: {name}", f"Version: {version}", *metadata]) + "\n\n"
    all_files = dict(files)
    all_files[f"{dist_info}/METADATA"] = meta
    all_files[f"{dist_info}/WHEEL"] = ("Wheel-Version: 1.0\nGenerator: setuptools (80.9.0)\n"
                                       "Root-Is-Purelib: false\nTag: cp311-cp311-manylinux_2_28_x86_64\n\n")
    all_files[f"{dist_info}/INSTALLER"] = "pip\n"
    all_files[f"{dist_info}/top_level.txt"] = "".join(f"{t}\n" for t in top_level)
    record = []
    for relative, text in all_files.items():
        path = site / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).decode().rstrip("=")
        record.append(f"{relative},sha256={digest},{len(text.encode())}")
    record.append(f"{dist_info}/RECORD,,")
    (site / dist_info / "RECORD").write_text("\n".join(record) + "\n")


def nvidia_smi_script(spec: HostProfile) -> str:
    """A POSIX sh stand-in for nvidia-smi: `--query-gpu=F,... --format=csv[,noheader][,nounits]`, `-L`, banner."""
    values = []
    for index, gpu in enumerate(spec.gpus):
        values.append(
            f'    {index}:name) echo "{gpu.name}" ;;\n'
            f'    {index}:compute_cap) echo "{gpu.compute_cap}" ;;\n'
            f'    {index}:memory.total) echo "{gpu.memory_mib}$unit" ;;\n'
            f'    {index}:uuid) echo "{gpu.uuid}" ;;\n'
        )
    listing = "".join(f'echo "GPU {i}: {g.name} (UUID: {g.uuid})"\n' for i, g in enumerate(spec.gpus))
    return f"""#!/bin/sh
# nvidia-smi stand-in of the ddtree-deploy sandbox host profile {spec.name}
query=; format=csv
for arg in "$@"; do
  case "$arg" in
    --query-gpu=*) query="${{arg#--query-gpu=}}" ;;
    --format=*) format="${{arg#--format=}}" ;;
    -L|--list-gpus) {listing.strip().replace(chr(10), '; ')}; exit 0 ;;
  esac
done
if [ -z "$query" ]; then
  echo "| NVIDIA-SMI {spec.driver_version}   Driver Version: {spec.driver_version}   CUDA Version: {spec.driver_cuda} |"
  exit 0
fi
unit=" MiB"
case ",$format," in *,nounits,*) unit= ;; esac
value() {{
  case "$1:$2" in
{''.join(values)}    *:driver_version) echo "{spec.driver_version}" ;;
    *:index) echo "$1" ;;
    *) echo "Field \\"$2\\" is not a valid field to query." >&2; exit 2 ;;
  esac
}}
for field in $(echo "$query" | tr ',' ' '); do value 0 "$field" >/dev/null || exit 2; done
header=$(echo "$query" | sed 's/,/, /g')
case ",$format," in *,noheader,*) ;; *) echo "$header" ;; esac
for gpu in {' '.join(str(i) for i in range(len(spec.gpus)))}; do
  line=
  for field in $(echo "$query" | tr ',' ' '); do
    v=$(value "$gpu" "$field") || exit 2
    line="${{line:+$line, }}$v"
  done
  echo "$line"
done
"""


def main(argv: list[str] | None = None) -> None:
    """`python -m sandbox.hosts FOLDER [PROFILE ...]`: build hosts under FOLDER/<profile>, print them as JSON."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("folder", type=Path)
    parser.add_argument("profiles", nargs="*", help=f"any of {', '.join(PROFILES)} (default: all)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.profiles) - set(PROFILES))
    if unknown:
        parser.error(f"unknown profile {unknown[0]!r}; known: {', '.join(PROFILES)}")
    hosts = [build_host(args.folder / profile, profile) for profile in args.profiles or PROFILES]
    print(json.dumps([json.loads(h.model_dump_json()) for h in hosts], indent=1))


if __name__ == "__main__":
    main()
