"""Overlay manifests, the pure plan and the rebase check: every bad input gives one line naming file and field."""

from __future__ import annotations

import hashlib
import shutil
import stat
from pathlib import Path

import pytest
from store_helpers import OVERLAYS

from ddtree_deploy.catalog import list_overlays, load_overlay
from ddtree_deploy.errors import DeployError, OverlayError, PreflightError
from ddtree_deploy.overlay import Overlay
from ddtree_deploy.plan import HostFile, Plan, plan
from ddtree_deploy.pristine import check_overlay

SERVER_ARGS = "sglang/srt/server_args.py"
SPEC_INFO = "sglang/srt/speculative/spec_info.py"
MINI_UTILS = "sglang/srt/speculative/mini_utils.py"


@pytest.fixture
def overlays(tmp_path: Path) -> Path:
    """A writable copy of the test overlays, to break on purpose."""
    target = tmp_path / "overlays"
    shutil.copytree(OVERLAYS, target)
    return target


def manifest_of(overlays: Path, version: str = "0.1.0") -> Path:
    return overlays / "mini" / version / "overlay.yaml"


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} not in {path}"
    path.write_text(text.replace(old, new, 1))


def facts_from(site: Path, paths: list[str]) -> dict[str, HostFile]:
    """What read_files would answer for a host holding `site`."""
    out = {}
    for rel in paths:
        path = site / rel
        if not path.exists():
            out[rel] = HostFile(exists=False)
            continue
        data = path.read_bytes()
        out[rel] = HostFile(exists=True, sha256=hashlib.sha256(data).hexdigest(), size=len(data),
                            mode=stat.S_IMODE(path.stat().st_mode), content=data)
    return out


def mini_plan(overlay: Overlay, site: Path, base: str = "0.5.17") -> Plan:
    return plan(overlay, base, facts_from(site, overlay.touched("0.5.17")), host="ct200")


def refused(overlays: Path, spec: str = "mini@0.1.0") -> OverlayError:
    with pytest.raises(OverlayError) as err:
        load_overlay(spec, overlays)
    assert err.value.bad_input and "\n" not in str(err.value)
    return err.value


def test_latest_version_by_semver_and_unknown_names_list_the_known_ones(overlays: Path) -> None:
    shutil.copytree(overlays / "mini" / "0.2.0", overlays / "mini" / "0.10.0")
    edit(manifest_of(overlays, "0.10.0"), "version: 0.2.0", "version: 0.10.0")
    assert load_overlay("mini", overlays).version == "0.10.0"
    assert load_overlay("mini@0.1.0", overlays).version == "0.1.0"
    assert "known overlays: mini" in refused(overlays, "nope").hint
    assert "0.1.0, 0.2.0, 0.10.0" in refused(overlays, "mini@9.9.9").hint


def test_malformed_yaml_names_the_file_and_line(overlays: Path) -> None:
    edit(manifest_of(overlays), "target:\n", "target: [unclosed\n")
    err = refused(overlays)
    assert str(manifest_of(overlays)) in str(err) and "malformed YAML" in str(err) and "line" in str(err)


@pytest.mark.parametrize(("old", "new", "field"), [
    ("description:", "colour: blue\ndescription:", "field colour: unknown key"),
    ("  package: sglang\n", "  package: sglang\n  flavour: x\n", "field target.flavour: unknown key"),
    ("version: 0.1.0", "version: one", "field version"),
    ("python: \">=3.8\"", "python: \"at least 3.8\"", "field requires.python"),
])
def test_unknown_keys_and_bad_fields_name_the_field(overlays: Path, old: str, new: str, field: str) -> None:
    edit(manifest_of(overlays), old, new)
    err = refused(overlays)
    assert str(manifest_of(overlays)) in str(err) and field in str(err)


@pytest.mark.parametrize("bad", ["../etc/passwd", "/etc/passwd", "sglang/../../etc/passwd", "sglang/./x.py",
                                 "torch/__init__.py"])
def test_paths_escaping_the_package_are_rejected_at_load(overlays: Path, bad: str) -> None:
    edit(manifest_of(overlays), f"  - {MINI_UTILS}", f"  - {MINI_UTILS}\n  - {bad}")
    err = refused(overlays)
    assert "field files.1" in str(err) and bad in str(err)


def test_patched_paths_escaping_the_package_are_rejected_at_load(overlays: Path) -> None:
    edit(manifest_of(overlays), f"    {SERVER_ARGS}:", "    sglang/../setup.py:")
    assert "escapes the package root" in str(refused(overlays))


def test_symlinks_inside_an_overlay_are_rejected(overlays: Path) -> None:
    target = overlays / "mini/0.1.0/files" / MINI_UTILS
    target.unlink()
    target.symlink_to("/etc/passwd")
    assert "symlinks are not allowed" in str(refused(overlays))


def test_missing_unlisted_and_misheaded_files_are_rejected(overlays: Path) -> None:
    root = overlays / "mini/0.1.0"
    (root / "files/sglang/extra.py").write_text("")
    assert "files/sglang/extra.py: not listed" in str(refused(overlays))
    (root / "files/sglang/extra.py").unlink()
    (root / "files" / MINI_UTILS).unlink()
    assert f"lists files/{MINI_UTILS}, which does not exist" in str(refused(overlays))
    shutil.copy(OVERLAYS / "mini/0.1.0/files" / MINI_UTILS, root / "files" / MINI_UTILS)
    edit(root / f"patches/0.5.17/{SPEC_INFO}.diff", f"+++ b/{SPEC_INFO}", "+++ b/sglang/other.py")
    assert "headers must be" in str(refused(overlays))


def test_unsupported_base_lists_the_supported_ones(pristine: Path) -> None:
    overlay = load_overlay("mini@0.1.0", OVERLAYS)
    with pytest.raises(OverlayError) as err:
        plan(overlay, "0.5.16", {}, host="ct200")
    assert err.value.code == "unsupported_base" and err.value.bad_input
    assert "no patch set for sglang 0.5.16; supported: 0.5.17" in str(err.value) and err.value.host == "ct200"


def test_plan_lists_writes_and_creations_and_prints_a_unified_diff(pristine: Path) -> None:
    the_plan = mini_plan(load_overlay("mini@0.1.0", OVERLAYS), pristine)
    assert [(c.path, c.action) for c in the_plan.changes] == [
        (SERVER_ARGS, "write"), (MINI_UTILS, "create"), (SPEC_INFO, "write")]
    text = the_plan.unified_diff()
    assert f"--- a/{SERVER_ARGS}\n+++ b/{SERVER_ARGS}\n" in text and "+MINI_OVERLAY = True\n" in text
    assert f"--- /dev/null\n+++ b/{MINI_UTILS}\n" in text and "+    def is_mini(self) -> bool:\n" in text
    assert not the_plan.noop and set(the_plan.files) == {SERVER_ARGS, SPEC_INFO, MINI_UTILS}


def test_a_patch_that_does_not_apply_names_file_and_hunk(overlays: Path, pristine: Path) -> None:
    diff = overlays / f"mini/0.1.0/patches/0.5.17/{SPEC_INFO}.diff"
    edit(diff, "     def is_dflash(self) -> bool:", "     def is_dflash_renamed(self) -> bool:")
    overlay = load_overlay("mini@0.1.0", overlays)
    with pytest.raises(OverlayError) as err:
        mini_plan(overlay, pristine)
    assert err.value.code == "patch_conflict" and f"{SPEC_INFO} hunk #1" in str(err.value)
    report = check_overlay(overlay)
    assert not report.ok and [(c.file, c.hunk) for c in report.bases[0].conflicts] == [(SPEC_INFO, 1)]


def test_a_host_file_that_is_not_pristine_is_refused_by_path(pristine: Path, tmp_path: Path) -> None:
    overlay = load_overlay("mini@0.1.0", OVERLAYS)
    facts = facts_from(pristine, overlay.touched("0.5.17"))
    facts[SERVER_ARGS] = facts[SERVER_ARGS].model_copy(update={"sha256": "0" * 64})
    with pytest.raises(PreflightError) as err:
        plan(overlay, "0.5.17", facts, host="ct200")
    assert err.value.code == "preimage_mismatch" and SERVER_ARGS in str(err.value) and err.value.host == "ct200"


def test_overlay_check_applies_and_byte_compiles_and_reports_compile_errors(overlays: Path) -> None:
    good = check_overlay(load_overlay("mini@0.1.0", overlays))
    assert good.ok and good.bases[0].compiled == 3 and good.bases[0].patched == [SERVER_ARGS, SPEC_INFO]
    (overlays / "mini/0.1.0/files" / MINI_UTILS).write_text("def broken(:\n")
    bad = check_overlay(load_overlay("mini@0.1.0", overlays))
    assert not bad.ok and bad.bases[0].compile_errors[0].startswith(f"{MINI_UTILS}: SyntaxError")


def test_overlay_list_shows_versions_bases_and_broken_ones(overlays: Path) -> None:
    edit(manifest_of(overlays, "0.2.0"), "description:", "colour: x\ndescription:")
    rows = list_overlays(overlays)
    assert [(r.name, r.version, r.bases, r.error is None) for r in rows] == [
        ("mini", "0.1.0", ["0.5.17"], True), ("mini", "0.2.0", [], False)]
    assert "unknown key" in str(rows[1].error)


def test_errors_are_deploy_errors_with_a_code_and_hint(overlays: Path) -> None:
    err = refused(overlays, "absent")
    assert isinstance(err, DeployError) and err.code == "unknown_overlay" and err.hint


def test_rebase_check_applies_the_newest_patch_set_to_an_unsupported_release(pristine: Path, tmp_path: Path) -> None:
    release = tmp_path / "cache/releases/sglang-0.5.99"  # a cached "next release": one file moved on upstream
    for rel in (SERVER_ARGS, SPEC_INFO):
        (release / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(pristine / rel, release / rel)
    (release / SERVER_ARGS).write_text("# new upstream header\n" + (release / SERVER_ARGS).read_text())
    overlay = load_overlay("mini@0.1.0", OVERLAYS)
    report = check_overlay(overlay, ["0.5.99"], cache=tmp_path / "cache")
    result = report.bases[0]
    assert report.ok and (result.base, result.patches_from) == ("0.5.99", "0.5.17")
    assert [n.split(":")[0] for n in result.notes] == [SERVER_ARGS]
    (release / SPEC_INFO).write_text((release / SPEC_INFO).read_text().replace("def is_dflash(", "def is_dflash2("))
    broken = check_overlay(overlay, ["0.5.99"], cache=tmp_path / "cache").bases[0]
    assert not broken.ok and [(c.file, c.hunk) for c in broken.conflicts] == [(SPEC_INFO, 1)]
