"""The models and settings `bench.push` and its Ansible baseline share: one timed command, and the bench's fleet."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel

from sandbox.hosts import SandboxHost

GOAL = 8.0
DDTREE, ANSIBLE = "ddtree-deploy", "Ansible"
HOSTS = {"ct129": "ct129", "ct200": "ct200", "ct129b": "ct129", "ct200b": "ct200"}  # name -> profile
CLI_TIMEOUT_S = 300
HEALTH_PATH = "/health_generate"


class Timing(BaseModel):
    """One timed command: which tool, which operation and round, how long, and where the time went."""

    tool: str
    op: str
    seconds: float
    load_1m: float = 0.0  # the machine's load average when it ended: the 2 cores are shared
    steps_s: dict[str, float] = {}  # ddtree-deploy only: each step's slowest host


class Bench(BaseModel):
    """What the bench's runs need to know about the fleet and the overlay."""

    root: Path
    overlay: str
    overlay_dir: Path
    server_args: list[str]
    new_files: list[str]  # package-relative paths the overlay creates
    patched: list[str]  # package-relative paths the overlay patches (for the hosts' release)
    inventory: Path
    files_inventory: Path
    env: dict[str, str]
    ansible_dir: Path
    hosts: dict[str, dict[str, SandboxHost]]  # by tool: each works on four hosts of its own
    ports: dict[str, dict[str, int]]  # by tool, then host: its stand-in server's port
