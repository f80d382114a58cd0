"""Native API, runs: create, add calls, set inputs, long-poll variables, inspect, cancel.

Every route is tenant-scoped: a run of another tenant answers exactly like a missing one
(404). Writes go through the manager, whose listener commits them before they return.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request

from parrot_backend.manager.runs import RunCancelled, RunNotFound, VariableFailed
from parrot_backend.program import RunSpec, UnknownVariableError
from parrot_backend.store import NotFoundError, RunDetail, RunRecord, VariableRecord

from .errors import APIError
from .native_chat import lower_calls, lower_run
from .native_errors import client_errors, not_found
from .native_schemas import (
    SQL_INT_MAX,
    AddCallsRequest,
    CallsAdded,
    CallView,
    NamePath,
    RunCreated,
    RunDetailView,
    RunIdPath,
    RunList,
    RunSummary,
    SetVariableRequest,
    VariableView,
)
from .runtime import NativeRuntime
from .state import StateDep, get_tenant

router = APIRouter(prefix="/v1", tags=["native"])

MAX_POLL_S = 300.0


def get_runtime(request: Request) -> NativeRuntime:
    return request.app.state.native


RuntimeDep = Annotated[NativeRuntime, Depends(get_runtime)]
TenantDep = Annotated[str, Depends(get_tenant)]


async def owned(rt: NativeRuntime, tenant: str, run_id: str) -> RunRecord:
    """The run if the tenant owns it; 404 otherwise (same answer for both)."""
    try:
        return await rt.owned(tenant, run_id)
    except NotFoundError:
        raise not_found(run_id) from None


def summary(run: RunRecord) -> RunSummary:
    return RunSummary(
        run_id=run.id,
        status=run.status,
        open=run.open and run.status in ("pending", "running"),  # an ended run takes nothing
        outputs=dict(run.objectives),
        created_at=run.created_at,
        finished_at=run.finished_at,
        replay_of=run.replay_of,
        workflow_id=run.workflow_id,
        error=run.error,
    )


def variable_view(v: VariableRecord) -> VariableView:
    return VariableView(
        name=v.name,
        status=v.status,
        value=v.value,
        error=v.error,  # type: ignore[arg-type]
        producer_call=v.producer_call,
        set_at=v.set_at,
        type=v.type,
    )


def detail_view(d: RunDetail) -> RunDetailView:
    calls = [
        CallView(
            idx=c.idx,
            name=c.name,
            inputs=list(c.inputs),
            outputs=list(c.outputs),
            status=c.status,
            engine=c.engine,
            objective=c.objective,
            task_group=c.task_group,
            attempts=c.attempts,
            queued_at=c.queued_at,
            started_at=c.started_at,
            first_token_at=c.first_token_at,
            finished_at=c.finished_at,
            completion_tokens=c.completion_tokens,
            error=c.error,
        )
        for c in d.calls
    ]
    return RunDetailView(
        run=summary(d.run),
        program=d.program,
        inputs=d.inputs,
        variables={n: variable_view(v) for n, v in d.variables.items()},
        calls=calls,
        task_groups=d.task_groups,
    )


@router.post(
    "/runs",
    response_model=RunCreated,
    status_code=201,
    responses={
        201: {
            "content": {"text/event-stream": {}},
            "description": "with `stream=true`: the run's events as SSE "
            "(its id in the X-Parrot-Run-Id header)",
        }
    },
)
async def create_run(
    spec: RunSpec, rt: RuntimeDep, tenant: TenantDep, state: StateDep, stream: bool = False
) -> Any:
    """Create a run from a program, its inputs and the outputs a client waits for
    (`latency` or `throughput`). Returns once the run is committed; calls start at once.
    Chat calls (`messages`) are rendered with the model's chat template first. With
    `stream=true` the answer is the run's event stream (as `GET /v1/runs/{id}/events`):
    one request creates a run and reads everything it produces."""
    with client_errors():
        spec = lower_run(spec, state.chat_template, state.special_tokens)
        run_id = await rt.create_run(tenant, spec)
    if stream:
        from .event_stream import event_response

        return event_response(rt, state, await rt.tenant_id(tenant), run_id, 0, status_code=201)
    return RunCreated(run_id=run_id)


@router.get("/runs", response_model=RunList)
async def list_runs(
    rt: RuntimeDep,
    tenant: TenantDep,
    status: Literal["pending", "running", "done", "failed", "cancelled"] | None = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    offset: Annotated[int, Query(ge=0, le=SQL_INT_MAX)] = 0,
) -> RunList:
    """The tenant's runs, newest first."""
    tenant_id = await rt.tenant_id(tenant)
    runs = await asyncio.to_thread(
        rt.store.list_runs, tenant_id, status=status, limit=limit, offset=offset
    )
    return RunList(runs=[summary(r) for r in runs])


@router.get("/runs/{run_id}", response_model=RunDetailView)
async def get_run(run_id: RunIdPath, rt: RuntimeDep, tenant: TenantDep) -> RunDetailView:
    """A run with its DAG, variables, objectives, task groups and call timings."""
    tenant_id = await rt.tenant_id(tenant)
    try:
        detail = await asyncio.to_thread(rt.store.get_run, tenant_id, run_id)
    except NotFoundError:
        raise not_found(run_id) from None
    return detail_view(detail)


@router.post("/runs/{run_id}/calls", response_model=CallsAdded)
async def add_calls(
    run_id: RunIdPath, body: AddCallsRequest, rt: RuntimeDep, tenant: TenantDep, state: StateDep
) -> CallsAdded:
    """Add calls to an open run (they start as soon as their inputs have values), then set
    `inputs`, then close the run when `close` is true: a client continuing a run after
    running code of its own needs one request for all three. All or nothing: when the run
    could not close (an input never given), neither the calls nor the inputs are kept."""
    await owned(rt, tenant, run_id)
    if not rt.live(tenant, run_id):
        raise APIError(409, f"run {run_id} is over; it takes no calls", code="run_closed")
    run = rt.manager.runs[run_id]
    if not run.open or run.state != "running":
        state_now = "closed" if run.state == "running" else run.state
        raise APIError(409, f"run {run_id} is {state_now}", code="run_closed")
    for name in body.inputs:
        var = run.program.variables.get(name)
        if var is not None and var.producer is not None:
            raise APIError(
                400,
                f"variable {name!r} is generated by call {var.producer!r}; only inputs can be set",
                code="not_an_input",
            )
        if name in run.values:
            raise APIError(409, f"input {name!r} already has a value", code="already_set")
    with client_errors(run_id):
        calls = []
        if body.calls:
            first = len(run.program.calls)
            calls = lower_calls(body.calls, state.chat_template, state.special_tokens, first)
            produced = {o for c in calls for o in c.build(0).outputs}
            clash = sorted(produced & set(body.inputs))
            if clash:
                raise APIError(
                    400,
                    f"variables given as inputs cannot be generated: {clash}",
                    code="program_error",
                )
        # all or nothing: a run that could not close keeps neither the calls nor the inputs
        names = await rt.manager.add_calls(
            run_id, calls, body.outputs, inputs=body.inputs, close=body.close
        )
    return CallsAdded(run_id=run_id, names=names)


@router.put("/runs/{run_id}/variables/{name}", response_model=VariableView)
async def set_variable(
    run_id: RunIdPath, name: NamePath, body: SetVariableRequest, rt: RuntimeDep, tenant: TenantDep
) -> VariableView:
    """Give an input variable of an open run its value (once: a second value is a 409)."""
    await owned(rt, tenant, run_id)
    if not rt.live(tenant, run_id):
        raise APIError(409, f"run {run_id} is over; it takes no inputs", code="run_closed")
    run = rt.manager.runs[run_id]
    if not run.open or run.state != "running":
        state = "closed" if run.state == "running" else run.state
        raise APIError(409, f"run {run_id} is {state}; it takes no inputs", code="run_closed")
    var = run.program.variables.get(name)
    if var is not None and var.producer is not None:
        raise APIError(
            400,
            f"variable {name!r} is generated by call {var.producer!r}; only inputs can be set",
            code="not_an_input",
        )
    if name in run.values:
        raise APIError(409, f"input {name!r} already has a value", code="already_set")
    with client_errors(run_id):
        await rt.manager.set_input(run_id, name, body.value)
    return VariableView(name=name, status="ready", value=body.value)


@router.post("/runs/{run_id}/close", response_model=RunSummary)
async def close_run(run_id: RunIdPath, rt: RuntimeDep, tenant: TenantDep) -> RunSummary:
    """Close an open run: no more calls or inputs; every input must have a value."""
    await owned(rt, tenant, run_id)
    if not rt.live(tenant, run_id):
        raise APIError(409, f"run {run_id} is over", code="run_closed")
    with client_errors(run_id):
        await rt.manager.close_run(run_id)
    return summary(await owned(rt, tenant, run_id))


async def wait_value(
    rt: NativeRuntime,
    run_id: str,
    name: str,
    perf: Literal["latency", "throughput"] | None,
    timeout: float,
) -> str:
    """The variable's value from the manager (`Manager.get`), waiting up to `timeout`
    seconds. One `get` is enough: it registers its wait before it awaits the objective
    deduction (and its listeners), so a value set meanwhile resolves it."""
    return await rt.manager.get(run_id, name, perf=perf, timeout=timeout)


STORE_POLL_S = 0.2  # how often a server polls the store for a run another server runs


@router.get(
    "/runs/{run_id}/variables/{name}",
    response_model=VariableView,
    responses={408: {"description": "not ready within `timeout`; ask again"}},
)
async def get_variable(
    run_id: RunIdPath,
    name: NamePath,
    rt: RuntimeDep,
    tenant: TenantDep,
    perf: Literal["latency", "throughput"] | None = None,
    timeout: Annotated[float, Query(ge=0, le=MAX_POLL_S)] = 30.0,
) -> VariableView:
    """A variable's value, waiting up to `timeout` seconds for it (long-poll). `perf`
    tells the scheduler what the client needs (latency: end-to-end time of this value;
    throughput: part of a batch) and re-deduces the run's objectives; omitted, the
    objectives the client stated (the run's `outputs`, an earlier `perf`) stand, and a
    run with none stated waits with latency. A failed variable answers with
    `status: failed`."""
    live = rt.live(tenant, run_id)
    if not live:
        # (a run this manager holds for the tenant is the tenant's: no store read, which
        # a fan-out's polls, arriving as its calls render, would each make in full)
        await owned(rt, tenant, run_id)
    if live:
        # once the manager has the value (or the failure) the store has it too (committed
        # first): the answer below comes from the store, with its producer and time
        try:
            await wait_value(rt, run_id, name, perf, timeout)
        except TimeoutError:
            raise APIError(
                408, f"variable {name!r} not ready after {timeout:g} s; ask again", code="timeout"
            ) from None
        except VariableFailed:
            pass
        except RunCancelled:
            raise APIError(409, f"run {run_id} was cancelled", code="run_cancelled") from None
        except UnknownVariableError as exc:
            raise APIError(404, str(exc), code="variable_not_found") from None
        except RunNotFound:
            pass  # finished and forgotten meanwhile: the store has the answer
    tenant_id = await rt.tenant_id(tenant)
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            var = await rt.read_variable(tenant_id, run_id, name)
        except NotFoundError as exc:
            raise APIError(404, str(exc), code="variable_not_found") from None
        if var.status != "pending":
            return variable_view(var)
        run = await owned(rt, tenant, run_id)
        if run.status not in ("pending", "running"):
            raise APIError(
                409,
                f"run {run_id} is {run.status}; variable {name!r} will not be produced",
                code="run_over",
            )
        # another server sharing the database runs it (or is about to adopt it): poll
        if asyncio.get_running_loop().time() >= deadline:
            raise APIError(
                408, f"variable {name!r} not ready after {timeout:g} s; ask again", code="timeout"
            )
        await asyncio.sleep(STORE_POLL_S)


@router.post("/runs/{run_id}/cancel", response_model=RunSummary)
async def cancel_run(run_id: RunIdPath, rt: RuntimeDep, tenant: TenantDep) -> RunSummary:
    """Stop a run: its calls stop and their engine contexts are freed. A finished run is
    left as it is."""
    await owned(rt, tenant, run_id)
    if rt.live(tenant, run_id):
        await rt.manager.cancel(run_id)
    return summary(await owned(rt, tenant, run_id))
