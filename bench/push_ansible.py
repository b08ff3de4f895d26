"""The baseline of `bench.push`: the same push and rollback as an Ansible expert would write them.

An ansible-core project (inventory, ansible.cfg with forks 4, pipelining and ControlPersist as
shipped, no fact gathering) with a push, a rollback and their files-only twins: `tar` the package,
`copy` the overlay's new files and pip's RECORD, `patch -p1` the patch set, restart the server's
process group, `uri` the health path with retries; rollback untars the archive exactly.
"""

from __future__ import annotations

import os
import subprocess
import time
from typing import TYPE_CHECKING, Any

import yaml

from bench.push_model import ANSIBLE, CLI_TIMEOUT_S, HEALTH_PATH, Bench, Timing
from ddtree_deploy.record import record_path
from sandbox.hosts import SGLANG_VERSION

if TYPE_CHECKING:
    from sshd_fleet import Fleet  # tests/integration, on the path that bench.push sets


def ansible_project(bench: Bench, fleet: Fleet, entries: dict[str, dict[str, Any]], pushed: dict[str, bytes]) -> None:
    """Write ansible.cfg, the inventory, the role's files (from `pushed`, what the push writes), the overlay's
    patch set as one diff, and the playbooks."""
    out = bench.ansible_dir
    out.mkdir()
    (out / "ansible.cfg").write_text(f"""\
[defaults]
inventory = {out / "hosts.ini"}
forks = 4
gathering = explicit
host_key_checking = True
retry_files_enabled = False
deprecation_warnings = False
local_tmp = {out / "tmp"}

[ssh_connection]
pipelining = True
control_path_dir = {out / "cp"}
""")
    lines = ["[eval]"]
    for name, host in fleet.hosts.items():
        service = entries[name]["service"]
        dist_info = next(p.name for p in host.package_root.glob("sglang-*.dist-info"))
        base = " ".join([*service["command"], *service["args"]])
        lines.append(
            f"{name} ansible_python_interpreter={host.python} pkg_root={host.package_root} "
            f"work={host.root / 'ansible'} dist_info={dist_info} server_port={service['port']} "
            f"server_cmd='{base}'"
        )
    lines += ["", "[eval:vars]", f"ansible_ssh_common_args='-F {fleet.ssh_config}'"]
    (out / "hosts.ini").write_text("\n".join(lines) + "\n")
    # the role's files/: the manifest's new files (the overlay folder may hold bytecode caches besides),
    # and pip's RECORD listing them, made on the controller (the hosts' trees are identical)
    for relative in [*bench.new_files, record_path(SGLANG_VERSION)]:
        (out / "files" / relative).parent.mkdir(parents=True, exist_ok=True)
        (out / "files" / relative).write_bytes(pushed[relative])
    patches = bench.overlay_dir / "patches" / SGLANG_VERSION
    (out / "overlay.diff").write_text("".join((patches / f"{p}.diff").read_text() for p in bench.patched))
    for name, tasks in playbooks(bench).items():
        play = [{"name": name, "hosts": "eval", "gather_facts": False, "tasks": tasks}]
        (out / f"{name}.yml").write_text(yaml.safe_dump(play, sort_keys=False, width=200))


def playbooks(bench: Bench) -> dict[str, list[dict[str, Any]]]:
    """The plays, by name: push and rollback with and without the restart, start, stop, prepare."""
    archive = "{{ work }}/sglang-before-push.tar"
    snapshot = {
        "name": "archive the installed package and its dist-info",
        "ansible.builtin.command": {"cmd": f"tar -cf {archive} sglang {{{{ dist_info }}}}", "chdir": "{{ pkg_root }}"},
    }
    copy = {
        "name": "copy the overlay's new files and pip's RECORD listing them",
        "ansible.builtin.copy": {"src": f"{bench.ansible_dir / 'files'}/", "dest": "{{ pkg_root }}/"},
    }
    patch = {
        "name": "apply the overlay's patch set",
        "ansible.builtin.command": {
            "cmd": "patch -p1 --forward --batch -d {{ pkg_root }}",
            "stdin": f"{{{{ lookup('ansible.builtin.file', '{bench.ansible_dir / 'overlay.diff'}', rstrip=False) }}}}",
            "stdin_add_newline": False,
        },
    }
    restore = {
        "name": "restore the archive exactly (files the overlay added go too)",
        "ansible.builtin.shell": {
            "cmd": f"rm -rf sglang {{{{ dist_info }}}} && tar -xf {archive}",
            "chdir": "{{ pkg_root }}",
        },
    }
    overlay_args = " ".join(bench.server_args)
    return {
        "prepare": [{"name": "work folder", "ansible.builtin.file": {"path": "{{ work }}", "state": "directory"}}],
        "start": [*restart_tasks("")],
        "stop": [stop_task()],
        "push": [snapshot, copy, patch, *restart_tasks(overlay_args)],
        "rollback": [restore, *restart_tasks("")],
        "push_files": [snapshot, copy, patch],
        "rollback_files": [restore],
    }


def stop_task() -> dict[str, Any]:
    script = """\
[ -f {{ work }}/server.pid ] || exit 0
pgid=$(cat {{ work }}/server.pid)
kill -TERM -- -$pgid 2>/dev/null || { rm -f {{ work }}/server.pid; exit 0; }
for i in $(seq 100); do
  kill -0 -- -$pgid 2>/dev/null || { rm -f {{ work }}/server.pid; exit 0; }
  sleep 0.05
done
kill -KILL -- -$pgid; rm -f {{ work }}/server.pid
"""
    return {
        "name": "stop the server: SIGTERM to its process group, SIGKILL after 5 s",
        "ansible.builtin.shell": {"cmd": script, "executable": "/bin/bash"},
    }


def restart_tasks(extra_args: str) -> list[dict[str, Any]]:
    start = (
        "setsid {{ server_cmd }} "
        + extra_args
        + " > {{ work }}/server.log 2>&1 < /dev/null & echo $! > {{ work }}/server.pid"
    )
    return [
        stop_task(),
        {
            "name": "wait until the port is free",
            "ansible.builtin.wait_for": {
                "host": "127.0.0.1",
                "port": "{{ server_port }}",
                "state": "stopped",
                "timeout": 30,
            },
        },
        {"name": "start the server detached, in its own process group", "ansible.builtin.shell": start},
        {
            "name": "wait for health",
            "ansible.builtin.uri": {"url": "http://127.0.0.1:{{ server_port }}" + HEALTH_PATH},
            "register": "health",
            "until": "health.status == 200",
            "retries": 240,
            "delay": 0.25,
        },
    ]


def ansible(bench: Bench, name: str, label: str) -> Timing:
    env = {
        **os.environ,
        "ANSIBLE_CONFIG": str(bench.ansible_dir / "ansible.cfg"),
        "ANSIBLE_HOME": str(bench.ansible_dir / "home"),
    }
    started = time.monotonic()
    proc = subprocess.run(
        ["ansible-playbook", f"{name}.yml"],
        cwd=bench.ansible_dir,
        env=env,
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        check=False,
    )
    seconds = time.monotonic() - started
    if proc.returncode != 0:
        raise SystemExit(
            f"ansible-playbook {name}.yml: exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-2000:]}"
        )
    return Timing(tool=ANSIBLE, op=label, seconds=seconds)


def close_ssh_masters(bench: Bench) -> None:
    """End Ansible's ControlPersist connections so nothing outlives the bench."""
    for sock in (bench.ansible_dir / "cp").glob("*"):
        subprocess.run(["ssh", "-o", f"ControlPath={sock}", "-O", "exit", "bench"], capture_output=True, check=False)
