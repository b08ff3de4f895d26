"""Where overlays are looked up: `--overlays`, $DDTREE_OVERLAYS, ./overlays, then the built-ins; the
first folder holding a name provides all its versions, and `overlay list` says where each came from."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ddtree_deploy.catalog import OVERLAYS_ENV, default_version, list_overlays, load_overlay, overlays_path
from ddtree_deploy.errors import OverlayError
from ddtree_deploy.resources import builtin_dir

MINI = Path(__file__).resolve().parents[1] / "store" / "overlays" / "mini"
REPO = Path(__file__).resolve().parents[2]


def folder_with(root: Path, *names: str) -> Path:
    """A folder of overlays holding mini's versions under each of `names` (renamed in their manifests)."""
    for name in names:
        shutil.copytree(MINI, root / name)
        for manifest in (root / name).glob("*/overlay.yaml"):
            manifest.write_text(manifest.read_text().replace("name: mini", f"name: {name}"))
    return root


@pytest.fixture
def folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """--overlays holds `alpha`; $DDTREE_OVERLAYS `alpha` and `beta`; ./overlays `beta` and `gamma`."""
    flag = folder_with(tmp_path / "flag", "alpha")
    env = folder_with(tmp_path / "env", "alpha", "beta")
    cwd = tmp_path / "work"
    folder_with(cwd / "overlays", "beta", "gamma")
    shutil.rmtree(env / "alpha" / "0.1.0")  # env's alpha lacks 0.1.0: never mixed into flag's alpha
    monkeypatch.setenv(OVERLAYS_ENV, str(env))
    monkeypatch.chdir(cwd)
    return {"flag": flag, "env": env, "cwd": cwd / "overlays"}


def test_the_first_folder_holding_a_name_provides_it(folders: dict[str, Path]) -> None:
    search = overlays_path(str(folders["flag"]))
    assert [(f.origin, f.path) for f in search.folders] == [
        ("--overlays", folders["flag"]), ("$DDTREE_OVERLAYS", folders["env"]), ("./overlays", folders["cwd"]),
        ("built-in", builtin_dir("overlays").resolve())]
    assert load_overlay("alpha", search).root == folders["flag"] / "alpha" / "0.2.0"
    assert load_overlay("alpha@0.1.0", search).root == folders["flag"] / "alpha" / "0.1.0"
    assert load_overlay("beta", search).root == folders["env"] / "beta" / "0.2.0"
    assert load_overlay("gamma", search).root == folders["cwd"] / "gamma" / "0.2.0"
    assert load_overlay("ddtree@0.2.2", search).root == builtin_dir("overlays").resolve() / "ddtree" / "0.2.2"
    origins = {(row.name, row.origin) for row in list_overlays(search)}
    assert {("alpha", "--overlays"), ("beta", "$DDTREE_OVERLAYS"), ("gamma", "./overlays"),
            ("ddtree", "built-in")} == origins
    # Without --overlays, $DDTREE_OVERLAYS's alpha (0.2.0 only, inheriting the 0.1.0 it lacks) is broken.
    rows = {(r.name, r.version): r for r in list_overlays(overlays_path(None))}
    assert rows["alpha", "0.2.0"].error and "field inherits: no version 0.1.0 of alpha" in rows["alpha", "0.2.0"].error


def test_unknown_names_list_every_folders_overlays(folders: dict[str, Path]) -> None:
    with pytest.raises(OverlayError) as err:
        load_overlay("delta", overlays_path(str(folders["flag"])))
    assert err.value.code == "unknown_overlay" and str(folders["flag"]) in str(err.value)
    assert err.value.hint == "known overlays: alpha, beta, ddtree, gamma"


@pytest.mark.parametrize("origin", ["--overlays", "$DDTREE_OVERLAYS"])
def test_a_named_folder_that_is_missing_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    origin: str) -> None:
    missing = tmp_path / "nowhere"
    if origin == "$DDTREE_OVERLAYS":
        monkeypatch.setenv(OVERLAYS_ENV, str(missing))
    with pytest.raises(OverlayError) as err:
        overlays_path(str(missing) if origin == "--overlays" else None)
    assert str(err.value) == f"no overlays folder {missing} (from {origin})"


def test_the_built_ins_are_the_repositorys_overlays_from_a_checkout(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(OVERLAYS_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    assert builtin_dir("overlays").resolve() == REPO / "overlays"
    assert builtin_dir("playbooks").resolve() == REPO / "playbooks"
    assert [f.origin for f in overlays_path(None).folders] == ["built-in"]
    assert load_overlay("ddtree").label == "ddtree@0.2.2"  # the newest release; 0.3.0-rc.1 only when named
    assert load_overlay("ddtree@0.3.0-rc.1").label == "ddtree@0.3.0-rc.1"
    rows = {f"{r.name}@{r.version}": r.default for r in list_overlays(overlays_path(None)) if r.name == "ddtree"}
    assert [label for label, default in rows.items() if default] == ["ddtree@0.2.2"]


def test_a_bare_name_takes_the_newest_release_as_pip_does() -> None:
    assert default_version(["0.1.0", "0.2.0", "0.3.0-rc.1"]) == "0.2.0"
    assert default_version(["0.1.0", "0.3.0-rc.1", "0.3.0"]) == "0.3.0"
    assert default_version(["0.1.0-rc.1", "0.1.0-rc.2"]) == "0.1.0-rc.2"  # no release yet: the newest
    assert default_version(["0.2.2", "0.3.0-rc.1", "0.4.0-hybrid.1"]) == "0.2.2"  # a tag PEP 440 cannot read
