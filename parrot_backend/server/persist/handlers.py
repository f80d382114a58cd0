"""What each manager event writes to the store, in one transaction per event.

A handler gets the event with the run's buffered events before it (`events`, the event
last) and hands its store work to `StorePersister.txn` once: that runs it on the writer
thread, in one transaction with the run's buffered call ends. An event type without a
handler of its own is only logged (`on_other`).
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from parrot_backend.manager.runs import RunOwnedElsewhere
from parrot_backend.program import CallSpec

from .meta import RunMeta

if TYPE_CHECKING:
    from .persister import StorePersister

Events = list[tuple[str, Any]]
Handler = Callable[["StorePersister", str, RunMeta, dict, Events], Awaitable[None]]

# manager run_finished status -> store run status
_RUN_STATUS = {"finished": "done", "failed": "failed", "cancelled": "cancelled"}


def _plain(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Call specs as a client could send them: the manager's `#<index>` names of unnamed
    calls are dropped (they are not valid user names, and rebuilding gives them back)."""
    return [{**c, "name": None} if str(c.get("name") or "").startswith("#") else c for c in calls]


def _descriptors(calls: list[dict[str, Any]], first: int) -> list[dict[str, Any]]:
    """The store's call descriptors (name, inputs, outputs, the types of typed outputs) of
    call specs, in order."""
    out = []
    for i, raw in enumerate(calls):
        call = CallSpec.model_validate(raw).build(first + i)
        desc: dict[str, Any] = {
            "name": call.name,
            "inputs": list(call.inputs),
            "outputs": list(call.outputs),
        }
        types = {o: c.value_type for o, c in call.configs.items() if c.value_type != "text"}
        if types:
            desc["types"] = types
        out.append(desc)
    return out


async def on_other(
    p: StorePersister, run_id: str, meta: RunMeta, payload: dict, events: Events
) -> None:
    """Any other event type: just log it."""
    rows = [(run_id, t, q) for t, q in events]
    await p.txn(meta, lambda: p.store.append_events(rows), single=True)


async def on_run_created(
    p: StorePersister, run_id: str, meta: RunMeta, payload: dict, events: Events
) -> None:
    st = p.store
    if meta.resumed:
        # the rows exist; the manager re-announced the run while recovering it
        await p.txn(meta, lambda: st.append_event(run_id, "run_resumed", {}), single=True)
        return
    program = dict(payload["program"])
    meta.program = program
    calls = _descriptors(program["calls"], 0)
    detail = await p.txn(
        meta,
        functools.partial(
            st.create_run,
            meta.tenant_id,
            program,
            calls,
            payload["inputs"],
            payload["outputs"],
            open=payload["open"],
            workflow_id=meta.workflow_id,
            replay_of=meta.replay_of,
            run_id=run_id,
            events=events,
            owner=p.worker,
            owner_lease_s=p.owner_lease_s,
        ),
        single=True,
    )
    meta.set_calls(detail.calls)


async def on_calls_added(
    p: StorePersister, run_id: str, meta: RunMeta, payload: dict, events: Events
) -> None:
    first = len(meta.program["calls"])
    added = _plain(payload["calls"])
    calls = _descriptors(added, first)
    program = {**meta.program, "calls": [*meta.program["calls"], *added]}
    await p.txn(
        meta,
        functools.partial(
            p.store.add_calls, meta.tenant_id, run_id, calls, program=program, events=events
        ),
        single=True,
    )
    meta.program = program
    await p.refresh_call_ids(run_id, meta)


async def on_objectives(
    p: StorePersister, run_id: str, meta: RunMeta, payload: dict, events: Events
) -> None:
    idx = meta.call_idx
    plans = {
        idx[name]: {
            "objective": o["objective"],
            "task_group": None if o["group"] is None else str(o["group"]),
        }
        for name, o in payload["calls"].items()
        if name in idx
    }
    # the waits beyond the run's outputs, kept for a resumed run to deduce from: none
    # recorded while there are none (`stated` then follows from the run's outputs)
    waits = payload.get("waits") or None
    work = functools.partial(
        p.store.annotate_calls,
        run_id,
        plans,
        waits=waits,
        stated=bool(payload.get("stated")),
        events=events,
    )
    await p.txn(meta, work, single=True)


async def on_run_closed(
    p: StorePersister, run_id: str, meta: RunMeta, payload: dict, events: Events
) -> None:
    st = p.store

    def work() -> None:
        st.close_run(meta.tenant_id, run_id)
        st.append_events([(run_id, t, q) for t, q in events])

    await p.txn(meta, work)


async def on_call_started(
    p: StorePersister, run_id: str, meta: RunMeta, payload: dict, events: Events
) -> None:
    st = p.store
    call = payload["call"]
    meta.first_token.pop(call, None)
    first = not meta.started

    def work() -> bool:
        if first:  # the run's first call also marks it running
            st.set_run_status(run_id, "running")
        return st.hold_call(
            meta.call_ids[call],
            p.worker,
            engine=payload.get("engine"),
            lease_s=p.lease_s,
            events=events,
        )

    held = await p.txn(meta, work, single=not first)
    meta.started = True
    if not held:  # another process runs it: this manager must not, nor record anything
        p.drop(run_id)
        raise RunOwnedElsewhere(f"call {call!r} of run {run_id} is held by another worker")


async def on_variable_ready(
    p: StorePersister, run_id: str, meta: RunMeta, payload: dict, events: Events
) -> None:
    st = p.store

    def work() -> None:
        changed = st.set_variables(run_id, {payload["name"]: payload["value"]}, events=events)
        if not changed and len(events) > 1:  # value was already there: keep the rest
            st.append_events([(run_id, t, q) for t, q in events[:-1]])

    await p.txn(meta, work, single=len(events) == 1)


async def on_variables_ready(
    p: StorePersister, run_id: str, meta: RunMeta, payload: dict, events: Events
) -> None:
    """Several values of the run at once (`StorePersister.on_values`): one transaction.
    A value already stored (a recovered run's) is not logged again, as alone."""
    st = p.store
    values = {v["name"]: v["value"] for v in payload["values"]}

    def work() -> None:
        changed = set(st.set_variables(run_id, values))
        kept = [(t, q) for t, q in events if t != "variable_ready" or q["name"] in changed]
        if kept:
            st.append_events([(run_id, t, q) for t, q in kept])

    await p.txn(meta, work)


async def on_variable_failed(
    p: StorePersister, run_id: str, meta: RunMeta, payload: dict, events: Events
) -> None:
    st = p.store

    def work() -> None:
        failed = st.fail_variable(run_id, payload["name"], payload["error"])
        kept = events if failed else events[:-1]
        if kept:
            st.append_events([(run_id, t, q) for t, q in kept])

    await p.txn(meta, work)


async def on_call_failed(
    p: StorePersister, run_id: str, meta: RunMeta, payload: dict, events: Events
) -> None:
    st = p.store
    call_id = meta.call_ids[payload["call"]]

    def work() -> None:
        # a call failed because an input failed never ran: claim it to record the failure
        st.hold_call(call_id, p.worker, start=False, lease_s=p.lease_s)
        st.fail_call(call_id, p.worker, payload["error"], events=events)

    await p.txn(meta, work)


async def on_run_finished(
    p: StorePersister, run_id: str, meta: RunMeta, payload: dict, events: Events
) -> None:
    st = p.store

    def work() -> None:
        changed = st.set_run_status(run_id, _RUN_STATUS[payload["status"]], events=events)
        if not changed and len(events) > 1:
            st.append_events([(run_id, t, q) for t, q in events[:-1]])

    await p.txn(meta, work, single=len(events) == 1)


HANDLERS: dict[str, Handler] = {
    "run_created": on_run_created,
    "calls_added": on_calls_added,
    "objectives": on_objectives,
    "run_closed": on_run_closed,
    "call_started": on_call_started,
    "variable_ready": on_variable_ready,
    "variables_ready": on_variables_ready,  # (several at once: not a manager event type)
    "variable_failed": on_variable_failed,
    "call_failed": on_call_failed,
    "run_finished": on_run_finished,
}
