"""`inherits`: a version holds only what it changes; loading resolves the rest from its parent chain,
and every way to get it wrong is one line naming the file and the field."""

from __future__ import annotations

import difflib
import shutil
from pathlib import Path

import pytest

from ddtree_deploy.catalog import load_overlay
from ddtree_deploy.errors import OverlayError
from ddtree_deploy.overlay import Overlay, export, read_overlay
from ddtree_deploy.plan import Plan, facts_needed, plan
from ddtree_deploy.pristine import pristine_release
from tests.overlay.plan_digests import BASE, pristine_facts

MINI = Path(__file__).resolve().parents[1] / "store" / "overlays" / "mini"
SERVER_ARGS = "sglang/srt/server_args.py"
SPEC_INFO = "sglang/srt/speculative/spec_info.py"
MINI_UTILS = "sglang/srt/speculative/mini_utils.py"
MINI_V2 = "sglang/srt/speculative/mini_v2.py"


@pytest.fixture
def mini(tmp_path: Path) -> Path:
    """A writable copy of the mini overlay (0.1.0, and 0.2.0 inheriting it), to break on purpose."""
    shutil.copytree(MINI, tmp_path / "overlays" / "mini")
    return tmp_path / "overlays" / "mini"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def child(mini: Path, version: str, manifest: str, parent: str = "0.2.0") -> Path:
    """A version `version` inheriting `parent`, with the given manifest lines after name/version/inherits."""
    write(mini / version / "overlay.yaml", f"name: mini\nversion: {version}\ninherits: {parent}\n{manifest}")
    return mini / version


def refused(root: Path) -> str:
    with pytest.raises(OverlayError) as err:
        read_overlay(root)
    assert err.value.bad_input and "\n" not in str(err.value)
    return str(err.value)


def pristine_plan(overlay: Overlay) -> Plan:
    release = pristine_release(BASE)
    return plan(overlay, BASE, {path: pristine_facts(release, path) for path in facts_needed(overlay, BASE)})


def test_a_child_resolves_its_parents_files_patches_and_fields(mini: Path) -> None:
    parent, overlay = read_overlay(mini / "0.1.0"), read_overlay(mini / "0.2.0")
    m = overlay.manifest
    assert (m.inherits, m.target.bases) == ("0.1.0", ["0.5.17"])  # target comes from 0.1.0
    assert m.files == [MINI_UTILS, MINI_V2] and list(m.patches["0.5.17"]) == [SPEC_INFO]  # server_args dropped
    assert overlay.patch_file("0.5.17", SPEC_INFO) == parent.patch_file("0.5.17", SPEC_INFO)  # 0.1.0's diff
    # Its change to 0.1.0's module is an edit: the diff applied to the parent's bytes, the parent's mode kept.
    assert overlay.source_of(MINI_UTILS, None) == mini / "0.1.0/files" / MINI_UTILS
    assert overlay.content_of(MINI_UTILS, None) != parent.content_of(MINI_UTILS, None)
    # Fields it sets are its own, even empty ones.
    assert (m.server.args, m.probes, m.requires.python) == ([], [], None)
    assert parent.manifest.server.args == ["--speculative-algorithm", "MINI"] and parent.manifest.probes
    assert overlay.held == [f"edits/{MINI_UTILS}.diff", f"files/{MINI_V2}"]


def test_fields_left_out_come_from_the_parent_whole(mini: Path) -> None:
    root = child(mini, "0.3.0", f"files: [{MINI_V2.replace('v2', 'v3')}]\n", parent="0.1.0")
    write(root / "files" / MINI_V2.replace("v2", "v3"), "V3 = True\n")
    overlay = read_overlay(root)
    parent = read_overlay(mini / "0.1.0").manifest
    for field in ("target", "requires", "server", "probes"):
        assert getattr(overlay.manifest, field) == getattr(parent, field), field
    assert overlay.manifest.description == ""  # a description is each version's own
    assert set(overlay.manifest.patches["0.5.17"]) == {SERVER_ARGS, SPEC_INFO}


def test_a_patch_or_file_of_the_child_replaces_the_parents_for_that_path(mini: Path) -> None:
    diff = (mini / "0.1.0/patches/0.5.17" / f"{SPEC_INFO}.diff").read_text()
    root = child(mini, "0.3.0", f"patches:\n  '0.5.17':\n    {SPEC_INFO}: "
                 f"{read_overlay(mini / '0.1.0').manifest.patches['0.5.17'][SPEC_INFO]}\n"
                 f"files: [{MINI_V2}]\n")
    write(root / "patches/0.5.17" / f"{SPEC_INFO}.diff", diff.replace("# mini overlay", "# mini overlay 0.3.0"))
    write(root / "files" / MINI_V2, "V2 = 3\n")
    overlay = read_overlay(root)
    assert overlay.patch_file("0.5.17", SPEC_INFO) == root / "patches/0.5.17" / f"{SPEC_INFO}.diff"
    assert overlay.source_of(MINI_V2, None) == root / "files" / MINI_V2
    assert overlay.content_of(MINI_UTILS, None) == read_overlay(mini / "0.2.0").content_of(MINI_UTILS, None)
    # A path the parent patched becomes a whole file: the child's kind wins.
    turned = child(mini, "0.4.0", f"files: [{SPEC_INFO}]\n", parent="0.3.0")
    write(turned / "files" / SPEC_INFO, "# replaced whole\n")
    m = read_overlay(turned).manifest
    assert SPEC_INFO in m.files and "0.5.17" not in m.patches


def test_a_byte_copy_of_the_parents_file_or_patch_is_refused(mini: Path) -> None:
    root = child(mini, "0.3.0", f"files: [{MINI_V2}]\n")
    write(root / "files" / MINI_V2, (mini / "0.2.0/files" / MINI_V2).read_text())
    message = refused(root)
    assert f"{root / 'overlay.yaml'}: field files: files/{MINI_V2} is a byte copy of" in message
    assert "(mini@0.2.0)" in message
    sha = read_overlay(mini / "0.1.0").manifest.patches["0.5.17"][SPEC_INFO]
    root = child(mini, "0.4.0", f"patches:\n  '0.5.17':\n    {SPEC_INFO}: {sha}\n")
    diff = mini / "0.1.0/patches/0.5.17" / f"{SPEC_INFO}.diff"
    write(root / "patches/0.5.17" / f"{SPEC_INFO}.diff", diff.read_text())
    assert f"field patches.0.5.17: patches/0.5.17/{SPEC_INFO}.diff is a byte copy of {diff}" in refused(root)


def test_cycles_missing_parents_and_bad_drops_are_refused(mini: Path) -> None:
    first = mini / "0.1.0/overlay.yaml"
    original = first.read_text()
    first.write_text(original.replace("version: 0.1.0\n", "version: 0.1.0\ninherits: 0.2.0\n"))
    assert f"{first}: field inherits: 0.2.0 -> 0.1.0 -> 0.2.0 is a cycle" in refused(mini / "0.2.0")
    first.write_text(original)
    root = child(mini, "0.3.0", "", parent="0.3.0")
    assert "field inherits: 0.3.0 -> 0.3.0 is a cycle" in refused(root)
    root = child(mini, "0.4.0", "", parent="9.9.9")
    assert f"{root / 'overlay.yaml'}: field inherits: no version 9.9.9 of mini" in refused(root)
    root = child(mini, "0.5.0", "", parent="latest")
    assert "field inherits: not a version of mini (got 'latest')" in refused(root)
    root = child(mini, "0.6.0", f"drops: [{SERVER_ARGS}]\n")  # 0.2.0 already dropped it
    assert f"{root / 'overlay.yaml'}: field drops: mini@0.2.0 does not ship {SERVER_ARGS}" in refused(root)


def test_drops_need_a_parent_and_cannot_be_shipped_too(mini: Path) -> None:
    manifest = mini / "0.1.0/overlay.yaml"
    original = manifest.read_text()
    manifest.write_text(original + f"drops: [{MINI_UTILS}]\n")
    assert f"{manifest}: field drops: needs inherits" in refused(mini / "0.1.0")
    manifest.write_text(original)
    manifest = mini / "0.2.0/overlay.yaml"
    manifest.write_text(manifest.read_text().replace(f"drops:\n  - {SERVER_ARGS}", f"drops:\n  - {MINI_V2}"))
    assert f"{MINI_V2} is both dropped and shipped" in refused(mini / "0.2.0")


def test_a_parents_error_names_the_parents_file(mini: Path) -> None:
    (mini / "0.1.0/files" / MINI_UTILS).unlink()
    assert f"{mini / '0.1.0/overlay.yaml'}: lists files/{MINI_UTILS}" in refused(mini / "0.2.0")


def test_an_exported_version_stands_alone_and_lands_the_same_bytes(mini: Path, tmp_path: Path) -> None:
    overlay = load_overlay("mini@0.2.0", mini.parent)
    target = tmp_path / "exported" / "mini" / "0.2.0"
    written = export(overlay, target)
    assert sorted(written) == sorted(["overlay.yaml", f"files/{MINI_UTILS}", f"files/{MINI_V2}",
                                      f"patches/0.5.17/{SPEC_INFO}.diff"])
    alone = read_overlay(target)
    assert alone.manifest.inherits is None and alone.held == sorted(written[1:])
    assert alone.manifest.model_dump(exclude={"inherits", "drops"}) == overlay.manifest.model_dump(
        exclude={"inherits", "drops"})
    mine, theirs = pristine_plan(overlay), pristine_plan(alone)
    assert mine.digest == theirs.digest and [c.model_dump() for c in mine.changes] == [
        c.model_dump() for c in theirs.changes]
    with pytest.raises(OverlayError, match="exists and is not an empty folder"):
        export(overlay, target)


def test_artifacts_are_inherited_per_cuda_variant(mini: Path) -> None:
    ext = "sglang/srt/speculative/mini_ext.so"
    built = f"artifacts:\n  cu128: {{torch: 2.11.0, files: [{ext}]}}\n"
    first = child(mini, "0.3.0", built)
    write(first / "files-cu128" / ext, "built against 2.11.0\n")
    later = child(mini, "0.4.0", "", parent="0.3.0")
    overlay = read_overlay(later)
    assert overlay.source_of(ext, "files-cu128") == first / "files-cu128" / ext
    assert overlay.touched("0.5.17", "files-cu128") == [ext, MINI_UTILS, MINI_V2, SPEC_INFO]
    rebuilt = child(mini, "0.5.0", built.replace("2.11.0", "2.11.1"), parent="0.4.0")
    write(rebuilt / "files-cu128" / ext, "built against 2.11.1\n")
    overlay = read_overlay(rebuilt)
    assert overlay.source_of(ext, "files-cu128") == rebuilt / "files-cu128" / ext
    assert overlay.manifest.artifacts["cu128"].torch == "2.11.1"
    write(rebuilt / "files-cu128" / ext, "built against 2.11.0\n")
    assert f"field artifacts.cu128: files-cu128/{ext} is a byte copy" in refused(rebuilt)


def edit_of(mini: Path, version: str, parent: str, old: str, new: str) -> Path:
    """A version of mini whose only change is an edit of the parent's mini_utils.py (old -> new text)."""
    root = child(mini, version, f"edits: [{MINI_UTILS}]\n", parent=parent)
    before = read_overlay(mini / parent).content_of(MINI_UTILS, None).decode()
    after = before.replace(old, new)
    lines = difflib.unified_diff(before.splitlines(True), after.splitlines(True), f"a/{MINI_UTILS}", f"b/{MINI_UTILS}")
    write(root / "edits" / f"{MINI_UTILS}.diff", "".join(lines))
    return root


def test_an_edit_applies_to_the_parents_bytes_and_chains_through_grandchildren(mini: Path) -> None:
    parent = read_overlay(mini / "0.2.0").content_of(MINI_UTILS, None).decode()
    line = parent.splitlines()[0]
    first = read_overlay(edit_of(mini, "0.3.0", "0.2.0", line, line + "  # 0.3.0"))
    assert first.content_of(MINI_UTILS, None).decode() == parent.replace(line, line + "  # 0.3.0", 1)
    second = read_overlay(edit_of(mini, "0.4.0", "0.3.0", "  # 0.3.0", "  # 0.4.0"))
    assert second.content_of(MINI_UTILS, None).decode() == parent.replace(line, line + "  # 0.4.0", 1)
    out = second.root.parent / "export"
    export(second, out)
    assert (out / "files" / MINI_UTILS).read_bytes() == second.content_of(MINI_UTILS, None)
    assert "edits" not in (out / "overlay.yaml").read_text()


def test_edits_that_do_not_apply_change_nothing_or_name_no_inherited_file_are_refused(mini: Path) -> None:
    stale = edit_of(mini, "0.3.0", "0.2.0", "", "")
    write(stale / "edits" / f"{MINI_UTILS}.diff",
          f"--- a/{MINI_UTILS}\n+++ b/{MINI_UTILS}\n@@ -1,1 +1,1 @@\n-no such line\n+other\n")
    assert "does not apply to mini@0.2.0" in refused(stale)
    first = read_overlay(mini / "0.2.0").content_of(MINI_UTILS, None).decode().splitlines()[0]
    noop = child(mini, "0.4.0", f"edits: [{MINI_UTILS}]\n", parent="0.2.0")  # a line replaced by itself
    write(noop / "edits" / f"{MINI_UTILS}.diff",
          f"--- a/{MINI_UTILS}\n+++ b/{MINI_UTILS}\n@@ -1,1 +1,1 @@\n-{first}\n+{first}\n")
    assert "changes nothing in mini@0.2.0's" in refused(noop)
    unknown = child(mini, "0.5.0", f"edits: [{SPEC_INFO}]\n", parent="0.2.0")
    write(unknown / "edits" / f"{SPEC_INFO}.diff", f"--- a/{SPEC_INFO}\n+++ b/{SPEC_INFO}\n@@ -1 +1 @@\n-a\n+b\n")
    assert "does not ship sglang/srt/speculative/spec_info.py as a whole file" in refused(unknown)


def derived_of(mini: Path, version: str, new: str, keep: int, extra: str = "") -> Path:
    """A version deriving `new` from the parent's MINI_UTILS: its first `keep` lines, and `extra`."""
    before = read_overlay(mini / "0.2.0").content_of(MINI_UTILS, None).decode()
    after = "".join(before.splitlines(True)[:keep]) + extra
    root = child(mini, version, f"derived:\n  {new}: {MINI_UTILS}\n")
    lines = difflib.unified_diff(before.splitlines(True), after.splitlines(True), f"a/{MINI_UTILS}", f"b/{new}")
    write(root / "edits" / f"{new}.diff", "".join(lines))
    return root


def test_a_derived_file_is_its_sources_bytes_through_the_diff_and_exports_whole(mini: Path) -> None:
    new = "sglang/srt/speculative/mini_split.py"
    parent = read_overlay(mini / "0.2.0")
    overlay = read_overlay(derived_of(mini, "0.3.0", new, 2, "SPLIT = True\n"))
    source = parent.content_of(MINI_UTILS, None).decode()
    assert overlay.content_of(new, None).decode() == "".join(source.splitlines(True)[:2]) + "SPLIT = True\n"
    assert overlay.content_of(MINI_UTILS, None) == parent.content_of(MINI_UTILS, None), "the source stays"
    assert new in overlay.manifest.files and overlay.manifest.derived == {}
    assert overlay.source_of(new, None) == parent.source_of(MINI_UTILS, None), "its mode is its source's"
    out = overlay.root.parent.parent / "exported" / "mini" / "0.3.0"
    export(overlay, out)
    assert (out / "files" / new).read_bytes() == overlay.content_of(new, None)
    assert "derived" not in (out / "overlay.yaml").read_text()
    assert pristine_plan(overlay).digest == pristine_plan(read_overlay(out)).digest, "a push lands the same"
    grandchild = read_overlay(child(mini, "0.4.0", "", parent="0.3.0"))
    assert grandchild.content_of(new, None) == overlay.content_of(new, None), "inherited like any file"


def test_derived_files_that_copy_clash_or_name_no_inherited_source_are_refused(mini: Path) -> None:
    new = "sglang/srt/speculative/mini_split.py"
    first = read_overlay(mini / "0.2.0").content_of(MINI_UTILS, None).decode().splitlines()[0]
    copy = derived_of(mini, "0.3.0", new, 1)  # then its one hunk replaced by a line kept as it was
    write(copy / "edits" / f"{new}.diff", f"--- a/{MINI_UTILS}\n+++ b/{new}\n@@ -1,1 +1,1 @@\n-{first}\n+{first}\n")
    assert "makes sglang/srt/speculative/mini_split.py a copy of mini@0.2.0's" in refused(copy)
    stale = derived_of(mini, "0.4.0", new, 1)
    write(stale / "edits" / f"{new}.diff", f"--- a/{MINI_UTILS}\n+++ b/{new}\n@@ -1,1 +1,1 @@\n-no such line\n+x\n")
    assert "does not apply to mini@0.2.0's sglang/srt/speculative/mini_utils.py" in refused(stale)
    headers = derived_of(mini, "0.5.0", new, 1)
    write(headers / "edits" / f"{new}.diff", f"--- a/{new}\n+++ b/{new}\n@@ -1,1 +1,1 @@\n-a\n+b\n")
    assert f"headers must be '--- a/{MINI_UTILS}' and '+++ b/{new}'" in refused(headers)
    unknown = child(mini, "0.6.0", f"derived:\n  {new}: {SPEC_INFO}\n")
    write(unknown / "edits" / f"{new}.diff", f"--- a/{SPEC_INFO}\n+++ b/{new}\n@@ -1 +1 @@\n-a\n+b\n")
    assert "field derived: mini@0.2.0 does not ship sglang/srt/speculative/spec_info.py as a whole file" in refused(
        unknown)
    clash = derived_of(mini, "0.7.0", MINI_V2, 1)
    assert "field derived: mini@0.2.0 already ships sglang/srt/speculative/mini_v2.py" in refused(clash)
    itself = child(mini, "0.8.0", f"derived:\n  {MINI_UTILS}: {MINI_UTILS}\n")
    write(itself / "edits" / f"{MINI_UTILS}.diff", f"--- a/{MINI_UTILS}\n+++ b/{MINI_UTILS}\n")
    assert "is made from itself" in refused(itself)
