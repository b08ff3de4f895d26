"""One playbook run on one host: what the operator asked (`RunOptions`), what preflight read (`Facts`),
what the steps produced (`Results`), and the contract a step keeps (`StepDef`, `StepOutcome`, `Fact`).

`HostRun` is what every step of `steps.py` takes; `playbook.py` checks the `needs`/`gives` of
each `StepDef` against the order of a playbook before any host is touched. Data only: no step
logic and no I/O here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ddtree_deploy import abi
from ddtree_deploy.inventory import HostSpec
from ddtree_deploy.overlay import Overlay
from ddtree_deploy.plan import Plan
from ddtree_deploy.probing import ProbeResult, Reference
from ddtree_deploy.protocol import DeployedState, HostState
from ddtree_deploy.remote.deployed import Adopted
from ddtree_deploy.remote.store import PruneResult, SnapshotTaken
from ddtree_deploy.remote.transactions import ApplyResult, RestoreResult
from ddtree_deploy.service import ServiceReport
from ddtree_deploy.transport import Transport

#: what a step can need or give: the run's overlay (the operator's input), what preflight reads, what steps make
Fact = Literal["overlay", "fingerprint", "host_state", "plan", "reference", "snapshot", "applied", "restored",
               "pruned", "adopted", "server", "probes"]


class StepOutcome(BaseModel):
    step: str
    status: Literal["ok", "noop", "failed", "skipped"]
    message: str = ""
    code: str | None = None
    hint: str = ""
    bad_input: bool = False
    duration_s: float = 0.0
    details: dict[str, Any] = Field(default_factory=dict)


class RunOptions(BaseModel):
    """What the operator asked for; the same for every host of a fleet run."""

    model_config = ConfigDict(extra="forbid")

    overlay: str | None = Field(default=None, description="NAME[@VERSION] to push")
    overlays_dir: str | None = None
    dry_run: bool = False
    force: bool = Field(default=False, description="push over drift / roll back across a changed fingerprint")
    no_rollback: bool = False
    to_snapshot: str | None = None
    keep_snapshots: int | None = Field(default=None, ge=1, description="prune: overrides the step's `keep`")
    lock_ttl_s: float = 3600.0


class Facts(BaseModel):
    """What preflight read from the host before anything changed it (the facts `fingerprint` and `host_state`)."""

    model_config = ConfigDict(frozen=True)

    fingerprint: abi.Fingerprint
    state: HostState

    @property
    def deployed(self) -> DeployedState | None:
        return self.state.deployed


class Results(BaseModel):
    """What the steps produced, each field by the step that `gives` it."""

    plan: Plan | None = None
    reference: Reference | None = None
    snapshot: SnapshotTaken | None = None
    applied: ApplyResult | None = None
    restored: RestoreResult | None = None
    pruned: PruneResult | None = None
    adopted: Adopted | None = None
    server: ServiceReport | None = None
    probes: list[ProbeResult] = Field(default_factory=list)


@dataclass
class HostRun:
    """One playbook run on one host: its inputs, the facts preflight read, the steps' results, and its course."""

    transport: Transport
    options: RunOptions
    overlay: Overlay | None = None
    on_progress: Callable[[str, str], None] | None = None
    facts: Facts | None = None  # set once, by preflight
    results: Results = field(default_factory=Results)
    server_args: list[str] = field(default_factory=list)  # the next start's: as last launched, planned or restored
    overlay_live: bool = False  # the overlay's files are on the host (its probes apply)
    reverify: bool = False  # the overlay was applied already but never verified: restart and probe it, apply nothing
    locked: bool = False
    changed: bool = False  # a snapshot was taken: from here on, a failure rolls back
    finished: str | None = None  # "noop" or "dry_run": the playbook ends early, successfully
    healthy: bool | None = None
    found_server_args: list[str] | None = None  # bench: the server args to put back (relaunch)

    @property
    def host(self) -> HostSpec:
        return self.transport.host

    @property
    def deployed(self) -> DeployedState | None:
        """What the host said was deployed when preflight read it (None without a preflight)."""
        return self.facts.deployed if self.facts is not None else None

    def progress(self, step: str) -> None:
        if self.on_progress is not None:
            self.on_progress(self.host.name, step)

    def summary(self) -> dict[str, Any]:
        """The evidence a report keeps beside the step outcomes."""
        made = self.results
        out: dict[str, Any] = {}
        if made.plan is not None:
            out["plan"] = {"overlay": f"{made.plan.overlay}@{made.plan.version}", "base": made.plan.base,
                           "digest": made.plan.digest, "changes": [c.model_dump() for c in made.plan.changes]}
            if self.options.dry_run:
                out["diff"] = made.plan.unified_diff()
        if made.snapshot is not None:
            out["snapshot"] = made.snapshot.id
        if made.restored is not None:
            out["restored"] = made.restored.model_dump()
        if made.pruned is not None:
            out["pruned"] = made.pruned.model_dump()
        if made.adopted is not None:
            out["adopted"] = made.adopted.snapshot.id
        if made.server is not None:
            out["server"] = made.server.model_dump(exclude={"stop"})
        if made.probes:
            out["probes"] = [p.model_dump() for p in made.probes]
        return out


class StepDef(BaseModel):
    """A step: its function, its arguments' model, and its contract with the steps around it."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    fn: Callable[[HostRun, Any], StepOutcome]
    args: type[BaseModel]
    needs: frozenset[Fact] = Field(default=frozenset(), description="facts an earlier step (or the run) must give")
    gives: frozenset[Fact] = Field(default=frozenset(), description="facts this step makes for later steps")
    changes_host: bool = Field(default=False, description="writes the host or restarts its server: a dry run "
                                                          "ends before it")


class NoArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
