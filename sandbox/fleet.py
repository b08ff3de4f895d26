"""The local sandbox fleet: two `transport: local` hosts shaped like ct129 and ct200, with stand-in servers.

`build_fleet(root)` makes `root/hosts/<name>/` (real sglang 0.5.17 files, cu130/cu128 torch
metadata; see hosts.py), `root/overlays/` (the repo's overlays plus the sandbox's broken one) and
`root/inventory.yaml`, whose services run `standin_server.py` (it stands in for the GPU server,
which cannot run here). Used by the demo and the tests.
"""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import yaml

from sandbox.hosts import SandboxHost, build_host

REPO = Path(__file__).resolve().parent.parent
STANDIN = REPO / "sandbox" / "standin_server.py"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def host_entry(host: SandboxHost, port: int, extra_args: list[str] | None = None) -> dict[str, object]:
    """Inventory keys of one sandbox host: local transport, its own PATH (nvidia-smi stand-in), a stand-in server."""
    service = {
        "kind": "process",
        "command": [str(host.python), str(STANDIN)],
        "args": ["--host", "127.0.0.1", "--port", str(port), "--package-root", str(host.package_root),
                 "--enable-metrics", *(extra_args or [])],
        "port": port,
        "ready_timeout_s": 60,
        "stop_grace_s": 5,
    }
    probes = [{"kind": "http", "path": "/health", "status": 200},
              {"kind": "lossless", "prompts": PROMPTS, "max_new_tokens": 32}]
    return host.inventory_entry(transport="local", groups=["eval"], service=service, probes=probes,
                                env={"PATH": f"{host.bin_dir}:/usr/local/bin:/usr/bin:/bin"})


def build_fleet(root: Path, names: tuple[str, ...] = ("ct129", "ct200"), extra_args: list[str] | None = None) -> Path:
    """Build the hosts, the overlays folder and the inventory under `root`; return the inventory path.

    `extra_args` go after every stand-in's own (test switches such as --standin-max-ddtree-budget).
    """
    root.mkdir(parents=True, exist_ok=True)
    hosts = {name: build_host(root / "hosts" / name, name) for name in names}
    for host in hosts.values():  # warm the stand-in's compile cache once, so no demo start pays for it
        subprocess.run([str(host.python), str(STANDIN), "--standin-compile-only", "--package-root",
                        str(host.package_root)], check=True, capture_output=True)
    overlays = root / "overlays"
    overlays.mkdir(exist_ok=True)
    for source in [*(REPO / "overlays").iterdir(), *(REPO / "sandbox" / "overlays").iterdir()]:
        if source.is_dir() and not (overlays / source.name).exists():
            (overlays / source.name).symlink_to(source)
    inventory = {"hosts": {name: host_entry(h, free_port(), extra_args) for name, h in hosts.items()}}
    path = root / "inventory.yaml"
    path.write_text("# The local sandbox fleet (built by sandbox/fleet.py).\n" + yaml.safe_dump(inventory, sort_keys=False))
    return path
