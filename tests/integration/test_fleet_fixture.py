"""The test fleet itself: simulated host trees are realistic and independent; sshd trouble fails loudly."""

from __future__ import annotations

import base64
import hashlib
import runpy
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import sshd_fleet
from sshd_fleet import Fleet, start_sshd

from ddtree_deploy.inventory import load_inventory
from ddtree_deploy.transport import transport_for
from sandbox.hosts import PROFILES, SandboxHost, release_image


def test_hosts_hold_the_real_release_as_pip_installed_it(fleet: Fleet) -> None:
    site = fleet.hosts["ct129"].package_root
    dist_info = site / "sglang-0.5.17.dist-info"
    assert "Version: 0.5.17" in (dist_info / "METADATA").read_text()
    assert (dist_info / "INSTALLER").read_text() == "pip\n"
    assert not (dist_info / "direct_url.json").exists()  # as if installed from the index, not a local file
    record = {line.split(",")[0]: line.split(",")[1] for line in (dist_info / "RECORD").read_text().splitlines()}
    spec_info = "sglang/srt/speculative/spec_info.py"
    assert record[spec_info] == "sha256=" + _record_digest(site / spec_info)
    assert (site / "sglang/srt/speculative/dflash_worker_v2.py").is_file()


def _record_digest(path: Path) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(path.read_bytes()).digest()).decode().rstrip("=")


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_profile_metadata_is_shaped_like_the_real_wheels(fleet: Fleet, name: str) -> None:
    site, profile = fleet.hosts[name].package_root, PROFILES[name]
    torch_info = site / f"torch-{profile.torch_version}.dist-info"
    metadata = (torch_info / "METADATA").read_text()
    assert f"Version: {profile.torch_version}" in metadata
    suffix = "-cu12==" if profile.torch_cuda.startswith("12") else "nvidia-cuda-runtime=="
    assert suffix in metadata
    for line in (torch_info / "RECORD").read_text().splitlines()[:-1]:
        path, digest, size = line.split(",")
        assert digest == "sha256=" + _record_digest(site / path) and int(size) == (site / path).stat().st_size
    version_py = runpy.run_path(str(site / "torch/version.py"))  # the file torch itself imports
    assert version_py["__version__"] == profile.torch_version and version_py["cuda"] == profile.torch_cuda
    kernel = site / f"sglang_kernel-{profile.sglang_kernel_version}.dist-info"
    assert "Requires-Dist: torch==2.11.0" in (kernel / "METADATA").read_text()


def test_stub_packages_refuse_to_import(fleet: Fleet) -> None:
    host = fleet.hosts["ct200"]
    out = subprocess.run([str(host.python), "-c", "import torch"], check=False, capture_output=True, text=True)
    assert out.returncode == 1 and "sandbox stand-in" in out.stderr


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_nvidia_smi_stand_in_answers_like_nvidia_smi(fleet: Fleet, name: str) -> None:
    smi, profile = str(fleet.hosts[name].bin_dir / "nvidia-smi"), PROFILES[name]
    query = subprocess.run([smi, "--query-gpu=name,driver_version,compute_cap", "--format=csv,noheader"],
                           capture_output=True, text=True, check=True).stdout
    assert query.splitlines() == [f"{g.name}, {profile.driver_version}, {g.compute_cap}" for g in profile.gpus]
    bad = subprocess.run([smi, "--query-gpu=name,bogus", "--format=csv"], check=False, capture_output=True,
                         text=True)
    assert bad.returncode == 2 and bad.stdout == "" and '"bogus"' in bad.stderr


def test_host_trees_are_independent_copies(fleet: Fleet) -> None:
    a = fleet.hosts["ct129"].package_root / "sglang/srt/speculative/spec_info.py"
    b = fleet.hosts["ct200"].package_root / "sglang/srt/speculative/spec_info.py"
    image = release_image() / "site-packages/sglang/srt/speculative/spec_info.py"
    inodes = {a.stat().st_ino, b.stat().st_ino, image.stat().st_ino}
    assert len(inodes) == 3  # no hard links: patching one host can never change another or the cache
    assert a.read_bytes() == b.read_bytes() == image.read_bytes()


def test_build_refuses_a_non_empty_root(make_host: Callable[..., SandboxHost], tmp_path: Path) -> None:
    root = tmp_path / "taken"
    root.mkdir()
    (root / "something").write_text("x")
    with pytest.raises(FileExistsError):
        make_host("ct129", root=root)


def test_missing_sshd_fails_with_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sshd_fleet, "SSHD", "/nonexistent/sbin/sshd")
    with pytest.raises(pytest.fail.Exception, match="apt-get install -y openssh-server"):
        sshd_fleet.require_sshd()


def test_sshd_that_exits_at_start_fails_with_its_log(
    fleet: Fleet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # sshd -t style failure: a host key file that is not a key makes sshd exit at once
    monkeypatch.setattr(sshd_fleet, "make_key", _broken_key)
    with pytest.raises(pytest.fail.Exception, match="did not start") as failed:
        start_sshd("ctbroken", fleet.hosts["ct129"], tmp_path / "sshd", fleet.client_key)
    assert "ctbroken" in str(failed.value)


def _broken_key(path: Path, comment: str) -> Path:
    path.write_text("not a key\n")
    path.with_suffix(".pub").write_text("not a key\n")
    return path


def test_the_fleet_answers_plain_openssh_too(fleet: Fleet) -> None:
    """The generated ssh_config and known_hosts work for the OpenSSH client, with strict checking."""
    out = subprocess.run(["ssh", "-F", str(fleet.ssh_config), "-o", "BatchMode=yes", "ct200", "command -v nvidia-smi"],
                         check=False, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(fleet.servers["ct200"].folder / "bin" / "nvidia-smi")


def test_fresh_fleet_is_its_own(fresh_fleet: Fleet, fleet: Fleet) -> None:
    assert fresh_fleet.folder != fleet.folder
    assert {s.port for s in fresh_fleet.servers.values()}.isdisjoint(s.port for s in fleet.servers.values())
    assert fresh_fleet.servers["ct129"].public_key != fleet.servers["ct129"].public_key
    assert fresh_fleet.hosts["ct129"].root != fleet.hosts["ct129"].root


def test_each_host_has_its_own_home_for_the_default_state_dir(fleet: Fleet, tmp_path: Path) -> None:
    inventory = fleet.write_inventory(tmp_path / "inventory.yaml",
                                      hosts={name: {"state_dir": "~/.local/state/ddtree-deploy"} for name in fleet.hosts})
    inv = load_inventory(str(inventory))
    for name, host in fleet.hosts.items():
        transport = transport_for(inv.hosts[name], inv.ssh)
        try:
            state_dir = Path(transport.call("lock", {"owner": "home-test"}) and transport.call("state")["state_dir"])
            transport.call("unlock", {"owner": "home-test"})
        finally:
            transport.close()
        assert state_dir.parent == fleet.servers[name].folder / "home" / ".local/state/ddtree-deploy"
        assert (host.home / ".local/state/ddtree-deploy" / state_dir.name).is_dir()
