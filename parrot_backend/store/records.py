"""Plain, immutable results of store operations (no ORM objects leave a unit of work)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any


@dataclass(frozen=True, slots=True)
class TenantRecord:
    """A tenant."""

    id: int
    name: str
    created_at: datetime


@dataclass(frozen=True, slots=True)
class WorkflowRecord:
    """One version of a stored workflow."""

    id: int
    tenant_id: int
    name: str
    version: int
    program: dict[str, Any]
    public: bool
    created_at: datetime


@dataclass(frozen=True, slots=True)
class VariableRecord:
    """A semantic variable of a run."""

    name: str
    status: str
    value: str | None
    producer_call: int | None
    set_at: datetime | None
    error: str | None = None
    type: str = "text"  # or the constraint of a typed output: json_schema, regex, choice


@dataclass(frozen=True, slots=True)
class CallRecord:
    """A call of a run with its claim, placement, objective and timings."""

    id: int
    run_id: str
    idx: int
    name: str | None
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    status: str
    engine: str | None
    objective: str | None
    task_group: str | None
    claimed_by: str | None
    lease_expires_at: datetime | None
    attempts: int
    queued_at: datetime
    started_at: datetime | None
    first_token_at: datetime | None
    finished_at: datetime | None
    prompt_tokens: int | None
    completion_tokens: int | None
    error: str | None


@dataclass(frozen=True, slots=True)
class RunRecord:
    """The summary of a run (what a listing shows)."""

    id: str
    tenant_id: int
    workflow_id: int | None
    status: str
    open: bool
    objectives: dict[str, Any]
    created_at: datetime
    finished_at: datetime | None
    replay_of: str | None
    error: str | None
    # waits beyond `objectives` (added calls' outputs, polls with perf) and whether a
    # client stated any criterion: what a resumed run deduces its objectives from too
    waits: dict[str, Any] = field(default_factory=dict)
    stated: bool = False


@dataclass(frozen=True, slots=True)
class RunDetail:
    """A run with its program, inputs, DAG (calls with their variables) and timings."""

    run: RunRecord
    program: dict[str, Any]
    inputs: dict[str, Any]
    variables: dict[str, VariableRecord]
    calls: tuple[CallRecord, ...]

    @property
    def task_groups(self) -> dict[str, list[int]]:
        """Call indices per task group."""
        groups: dict[str, list[int]] = {}
        for call in self.calls:
            if call.task_group is not None:
                groups.setdefault(call.task_group, []).append(call.idx)
        return groups


@dataclass(frozen=True, slots=True)
class UnfinishedRun:
    """What recovery needs to resume a run: its program, ready values and calls not done."""

    run: RunRecord
    program: dict[str, Any]
    ready: dict[str, str]
    calls: tuple[CallRecord, ...]


@dataclass(frozen=True, slots=True)
class ClaimedCall:
    """A call claimed by a worker, with the values of its (all ready) inputs."""

    call: CallRecord
    tenant_id: int
    input_values: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class EventRecord:
    """One event of a run's log; ``seq`` is the SSE id."""

    run_id: str
    seq: int
    type: str
    payload: Any
    created_at: datetime


@dataclass(frozen=True, slots=True)
class FinishResult:
    """Outcome of recording a call's outputs.

    ``accepted`` is False when the caller no longer held the claim (its lease expired and
    another worker took the call, or the call was already finished): nothing was written.
    ``changed`` names the variables this call made ready (a ready one is never overwritten).
    """

    accepted: bool
    changed: tuple[str, ...] = ()
    seqs: tuple[int, ...] = ()
