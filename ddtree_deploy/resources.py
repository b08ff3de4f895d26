"""Package data: the built-in overlays and playbooks that ship inside ddtree-deploy.

They live in the repository's top-level `overlays/` and `playbooks/` (DESIGN.md's layout) and ship
in the wheel as `ddtree_deploy/_builtin_overlays/` and `ddtree_deploy/_builtin_playbooks/`
(pyproject's package-dir mapping). They are found with `importlib.resources`; where the package
runs from a checkout (an editable install or a source tree on sys.path: setuptools' editable finder
does not map a folder without `__init__.py`), they are the checkout's own folders beside it.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path
from typing import Literal


def builtin_dir(kind: Literal["overlays", "playbooks"]) -> Path:
    """The folder of built-in overlays or playbooks (it may not exist in a stripped checkout)."""
    package = Path(str(files("ddtree_deploy")))  # installed wheels are unpacked: a real folder
    shipped = package / f"_builtin_{kind}"
    return shipped if shipped.is_dir() else package.parent / kind
