"""Client of hostside/facts.py: the host's fingerprint."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ddtree_deploy.transport import Transport


def fingerprint(t: Transport, *, deep: bool = False) -> dict[str, Any]:
    """The `fingerprint` op's answer, for `abi.Fingerprint.from_helper` (abi owns the fingerprint's model).

    `deep` also imports torch and sgl_kernel in a child of the host's python (seconds).
    """
    return t.call("fingerprint", {"deep": deep})
