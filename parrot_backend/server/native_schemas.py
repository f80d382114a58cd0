"""Request and response models of the native API (runs, variables, workflows).

Programs use the shared JSON form (`parrot_backend.program.spec`): `RunSpec` is the body
of `POST /v1/runs` as it is. Responses are plain views of the store's records.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import Depends, Path
from pydantic import BaseModel, ConfigDict, Field, model_validator

from parrot_backend.program import Criterion, ProgramSpec
from parrot_backend.program.spec import AnyCallSpec, check_names
from parrot_backend.program.template import NAME_PATTERN
from parrot_backend.program.text import MAX_NAME_LENGTH, StorableModel

from .native_errors import not_found

WorkflowName = Field(pattern=f"^{NAME_PATTERN}$", max_length=MAX_NAME_LENGTH)

# Path parameters are checked before they reach a query (a NUL in an id made
# PostgreSQL's driver raise, a 500): a run id is what the server hands out, so any other
# id is a run that does not exist (404, as for another tenant's run); names are variable
# or workflow names (400).
_RUN_ID = re.compile(r"[0-9a-f]{32}")


def _run_id(run_id: Annotated[str, Path(description="a run id: 32 lowercase hex digits")]) -> str:
    if _RUN_ID.fullmatch(run_id) is None:
        raise not_found(run_id[:64])
    return run_id


RunIdPath = Annotated[str, Depends(_run_id)]
NamePath = Annotated[
    str,
    Path(
        pattern=f"^{NAME_PATTERN}$",
        max_length=MAX_NAME_LENGTH,
        description="a variable or workflow name",
    ),
]

# The largest integer SQL BIGINT and SQLite INTEGER hold. Client integers that reach a
# query (offsets, event seqs, versions) are bounded by it: a larger one made the driver
# raise OverflowError, a 500 (or a stream cut off after its 200), instead of a 400.
SQL_INT_MAX = 2**63 - 1


class _Strict(StorableModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class AddCallsRequest(_Strict):
    """Calls to add to an open run, outputs the client will wait for (as a run's `outputs`:
    declared with the calls, so that they start with that objective), inputs to set after
    them, and whether to close it."""

    calls: list[AnyCallSpec] = Field(default_factory=list, max_length=1000)
    outputs: dict[str, Criterion] = Field(default_factory=dict)
    inputs: dict[str, str] = Field(default_factory=dict)
    close: bool = False

    @model_validator(mode="after")
    def _something(self) -> AddCallsRequest:
        if not (self.calls or self.inputs or self.close):
            raise ValueError("give calls, inputs or close: true")
        check_names(self.inputs)
        check_names(self.outputs)
        return self


class SetVariableRequest(_Strict):
    """The value of an input variable."""

    value: str


class ReplayRequest(_Strict):
    """Replay a run: its program again, with its inputs, or these (merged over them)."""

    inputs: dict[str, str] = Field(default_factory=dict)


class RegisterWorkflowRequest(_Strict):
    """Store `program` as the next version of the workflow `name`.

    `public` lets every run of it share cached prefixes across tenants.
    """

    name: str = WorkflowName
    program: ProgramSpec
    public: bool = False


class StartWorkflowRequest(_Strict):
    """Run a stored workflow (the latest version unless `version` is given)."""

    inputs: dict[str, str] = Field(default_factory=dict)
    outputs: dict[str, Criterion] = Field(default_factory=dict)
    version: int | None = Field(None, ge=1, le=SQL_INT_MAX)


class RunCreated(BaseModel):
    """A run was created and committed."""

    run_id: str
    replay_of: str | None = None
    workflow: str | None = None
    version: int | None = None


class CallsAdded(BaseModel):
    """Names of the calls added (unnamed ones become `#<index>`)."""

    run_id: str
    names: list[str]


class VariableView(BaseModel):
    """A semantic variable: `pending`, `ready` (with `value`) or `failed` (with `error`).
    `type`: `text`, or the constraint its value was generated under (`json_schema`,
    `regex`, `choice`)."""

    name: str
    status: Literal["pending", "ready", "failed"]
    type: str = "text"
    value: str | None = None
    error: str | None = None
    producer_call: int | None = None
    set_at: datetime | None = None


class CallView(BaseModel):
    """One call of a run: its place in the DAG, objective, task group and timings."""

    idx: int
    name: str | None
    inputs: list[str]
    outputs: list[str]
    status: str
    engine: str | None
    objective: str | None
    task_group: str | None
    attempts: int
    queued_at: datetime
    started_at: datetime | None
    first_token_at: datetime | None
    finished_at: datetime | None
    completion_tokens: int | None
    error: str | None


class RunSummary(BaseModel):
    """A run as listings show it. `status`: pending, running, done, failed, cancelled."""

    run_id: str
    status: str
    open: bool
    outputs: dict[str, Any]
    created_at: datetime
    finished_at: datetime | None
    replay_of: str | None
    workflow_id: int | None
    error: str | None


class RunList(BaseModel):
    """A page of a tenant's runs, newest first."""

    runs: list[RunSummary]


class RunDetailView(BaseModel):
    """A run with its program, DAG (calls and variables), objectives and task groups."""

    run: RunSummary
    program: dict[str, Any]
    inputs: dict[str, Any]
    variables: dict[str, VariableView]
    calls: list[CallView]
    task_groups: dict[str, list[int]]


class WorkflowView(BaseModel):
    """One version of a stored workflow."""

    name: str
    version: int
    public: bool
    created_at: datetime
    program: dict[str, Any]


class WorkflowList(BaseModel):
    """Every workflow version of the tenant."""

    workflows: list[WorkflowView]
