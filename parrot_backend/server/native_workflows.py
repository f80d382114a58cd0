"""Native API, workflows and replay: stored programs run again, same or new inputs.

A workflow is a program stored under a name, versioned per tenant. A public workflow's
runs share cached prefixes across tenants (their program is marked public); every other
run's prefixes carry the tenant's server-derived salt. Replay runs a past run's program
again with its inputs (or new ones merged over them): with greedy decoding the outputs
equal the original's.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from pydantic import ValidationError

from parrot_backend.program import ProgramSpec, RunSpec
from parrot_backend.store import NotFoundError, WorkflowRecord

from .errors import APIError
from .native_api import RuntimeDep, TenantDep
from .native_chat import lower_program
from .native_errors import client_errors, not_found
from .native_schemas import (
    NamePath,
    RegisterWorkflowRequest,
    ReplayRequest,
    RunCreated,
    RunIdPath,
    StartWorkflowRequest,
    WorkflowList,
    WorkflowView,
)
from .state import StateDep

router = APIRouter(prefix="/v1", tags=["native"])


def workflow_view(w: WorkflowRecord) -> WorkflowView:
    return WorkflowView(
        name=w.name, version=w.version, public=w.public, created_at=w.created_at, program=w.program
    )


def _spec(program: dict, inputs: dict[str, str], outputs: dict) -> RunSpec:
    """A closed run of a stored program (stored JSON was valid when it was stored)."""
    try:
        return RunSpec(program=ProgramSpec.model_validate(program), inputs=inputs, outputs=outputs)
    except ValidationError as exc:
        raise APIError(
            400, f"stored program no longer valid: {exc.errors()[0]['msg']}", code="program_error"
        ) from None


@router.post("/workflows", response_model=WorkflowView, status_code=201)
async def register_workflow(
    body: RegisterWorkflowRequest, rt: RuntimeDep, tenant: TenantDep, state: StateDep
) -> WorkflowView:
    """Store a program under a name; each registration is the next version. Chat calls
    are stored rendered with the served model's chat template."""
    with client_errors():
        program = lower_program(body.program, state.chat_template, state.special_tokens)
        program.build()  # templates and structure checked now, not at the first run
    program = program.model_copy(update={"public": program.public or body.public})
    tenant_id = await rt.tenant_id(tenant)
    record = await asyncio.to_thread(
        rt.store.register_workflow,
        tenant_id,
        body.name,
        program.model_dump(mode="json"),
        public=body.public,
    )
    return workflow_view(record)


@router.get("/workflows", response_model=WorkflowList)
async def list_workflows(rt: RuntimeDep, tenant: TenantDep) -> WorkflowList:
    """Every workflow version of the tenant, by name then version."""
    tenant_id = await rt.tenant_id(tenant)
    rows = await asyncio.to_thread(rt.store.list_workflows, tenant_id)
    return WorkflowList(workflows=[workflow_view(w) for w in rows])


@router.post("/workflows/{name}/runs", response_model=RunCreated, status_code=201)
async def start_workflow(
    name: NamePath, body: StartWorkflowRequest, rt: RuntimeDep, tenant: TenantDep
) -> RunCreated:
    """Run a stored workflow with inputs."""
    tenant_id = await rt.tenant_id(tenant)
    try:
        wf = await asyncio.to_thread(rt.store.get_workflow, tenant_id, name, body.version)
    except NotFoundError as exc:
        raise APIError(404, str(exc), code="workflow_not_found") from None
    spec = _spec(wf.program, body.inputs, body.outputs)
    with client_errors():
        run_id = await rt.create_run(tenant, spec, workflow_id=wf.id)
    return RunCreated(run_id=run_id, workflow=wf.name, version=wf.version)


@router.post("/runs/{run_id}/replay", response_model=RunCreated, status_code=201)
async def replay_run(
    run_id: RunIdPath, rt: RuntimeDep, tenant: TenantDep, body: ReplayRequest | None = None
) -> RunCreated:
    """Run a past run's program again: its inputs, with `inputs` merged over them, and
    the objectives the past run ended with: the outputs it was created with, and what its
    client stated after (outputs of calls it added, `perf` of its polls) over them."""
    tenant_id = await rt.tenant_id(tenant)
    try:
        detail = await asyncio.to_thread(rt.store.get_run, tenant_id, run_id)
    except NotFoundError:
        raise not_found(run_id) from None
    given = {
        n: v.value or ""
        for n, v in detail.variables.items()
        if v.producer_call is None and v.status == "ready"
    }
    body = body or ReplayRequest()
    unknown = [n for n in body.inputs if n not in given and n not in detail.variables]
    if unknown:
        raise APIError(400, f"run {run_id} has no input(s) {unknown}", code="unknown_variable")
    stated = {**detail.run.objectives, **detail.run.waits}  # later statements win
    outputs = {n: c for n, c in stated.items() if n in detail.variables}
    spec = _spec(detail.program, {**given, **body.inputs}, outputs)
    wf = None
    if detail.run.workflow_id is not None:  # a run of a workflow: its replay is one too
        wf = await asyncio.to_thread(rt.store.workflow_by_id, tenant_id, detail.run.workflow_id)
    with client_errors():
        new_id = await rt.create_run(
            tenant, spec, workflow_id=detail.run.workflow_id, replay_of=run_id
        )
    return RunCreated(
        run_id=new_id,
        replay_of=run_id,
        workflow=wf.name if wf else None,
        version=wf.version if wf else None,
    )
