"""The one error tree of ddtree-deploy: a root `DeployError` and one subclass per phase.

Every error carries a stable `code` (used in the `--json` envelope), the `host` it concerns (or
None), a `hint` saying what to do, and, when a host helper answered, its `HelperResult`
(`protocol.py`; typed here as a model only, since the protocol raises these errors). Any module
raises these; only `cli.py` formats them.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


class DeployError(Exception):
    """Root of every error the tool reports on purpose."""

    #: stable machine-readable code, overridden per subclass or per raise
    code: str = "deploy_error"
    #: True when the cause is the user's input (exit code 2), not a host's behaviour
    bad_input: bool = False

    def __init__(
        self,
        message: str,
        *,
        host: str | None = None,
        hint: str = "",
        code: str | None = None,
        result: BaseModel | None = None,
        details: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.host = host
        self.hint = hint
        self.result = result
        self.details = details or {}
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        prefix = f"{self.host}: " if self.host and not self.message.startswith(f"{self.host}:") else ""
        return f"{prefix}{self.message}"


class UsageError(DeployError):
    code = "invalid_input"
    bad_input = True


class InventoryError(DeployError):
    code = "inventory_invalid"
    bad_input = True


class OverlayError(DeployError):
    code = "overlay_invalid"
    bad_input = True


class PlaybookError(DeployError):
    code = "playbook_invalid"
    bad_input = True


class AbiError(DeployError):
    code = "abi_mismatch"


class TransportError(DeployError):
    code = "unreachable"


class HostKeyError(TransportError):
    code = "host_key_rejected"


class HelperError(DeployError):
    """The host helper answered with an error (or not with JSON)."""

    code = "helper_failed"


class PreflightError(DeployError):
    """A host is not in a state a push may start from (locked, open journal, drift)."""

    code = "preflight_failed"


class ServiceError(DeployError):
    code = "service_failed"


class ProbeError(DeployError):
    code = "probe_failed"


class BenchError(DeployError):
    """A bench could not measure (a request failed, a variant answered unlike the plain server)."""

    code = "bench_failed"
