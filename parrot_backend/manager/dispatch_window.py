"""The dispatch window: which ready calls a dispatcher round offers the scheduling policy.

The rule (written here only; the policy and the manager refer to it):

At most `max_batch - batch_size` calls fit on each reachable engine (`slots` in all), so
when more calls are ready only about that many are offered. Order of choice: aged calls
(waiting at least `aging_s`, oldest first), then latency calls, then throughput calls;
within each kind every tenant first gets an equal share of the slots, split equally among
its runs (a tenant or run with a thousand ready calls does not hold back one with a single
call), then the oldest fill the rest. A call in a task group brings every queued member
of its group, and they all count against the slots and its run's share: groups are never
split. A group that does not fit in the slots left is passed over this round (smaller
work after it may fill them), unless nothing is chosen yet: the first unit in this order
is always offered whole, even a group larger than all the slots, so aging still
guarantees that every group is offered.

Without the window a backlog makes every round cost as much as the whole backlog; with
it a round costs in the slots (each pass stops once they are taken, and the queue's
counts say how many runs and latency calls are queued).
"""

from __future__ import annotations

from collections.abc import Iterable

from .ready_queue import ReadyCall, ReadyQueue


def dispatch_window(queue: ReadyQueue, slots: int, old: float) -> list[ReadyCall]:
    """The queued calls to offer this round, given `slots` batch slots; calls enqueued
    before `old` are aged (the module doc states the rule)."""
    pending = queue.calls
    if len(pending) <= slots:
        return list(pending.values())
    chosen: dict[str, ReadyCall] = {}
    taken: dict[str, int] = {}  # run id -> calls chosen (a dict: no __missing__ calls)
    by_tenant: dict[str | None, int] = {}  # tenant -> calls chosen
    passed: set[tuple[str, int]] = set()  # groups that did not fit this round

    def take(r: ReadyCall) -> None:
        """Choose `r`, with its whole task group when it has one, if it fits."""
        tenant = r.run.tenant
        if r.group is None:
            chosen[r.call_id] = r
            taken[r.run.run_id] = taken.get(r.run.run_id, 0) + 1
            by_tenant[tenant] = by_tenant.get(tenant, 0) + 1
            return
        gkey = (r.run.run_id, r.group)
        if gkey in passed:
            return
        members = [
            q
            for q in r.run.queued.values()
            if q.group == r.group and pending.get(q.call_id) is q and q.call_id not in chosen
        ]
        if chosen and len(chosen) + len(members) > slots:
            passed.add(gkey)
            return
        for q in members:
            chosen[q.call_id] = q
        taken[r.run.run_id] = taken.get(r.run.run_id, 0) + len(members)
        by_tenant[tenant] = by_tenant.get(tenant, 0) + len(members)

    for r in pending.values():  # in enqueue order: the aged ones come first
        if r.enqueued_at >= old or len(chosen) >= slots:
            break
        if r.call_id not in chosen:
            take(r)
    tenants = queue.tenants
    share = max(1, slots // len(tenants))
    for want_latency in (True, False):
        if want_latency:
            if not queue.latency:
                continue
            source: Iterable[ReadyCall] = [r for r in pending.values() if r.objective == "latency"]
        else:
            source = pending.values()
        for fair in (True, False):
            if len(chosen) >= slots:
                break
            for r in source:
                if len(chosen) >= slots:
                    break
                if (r.objective == "latency") != want_latency or r.call_id in chosen:
                    continue
                if fair:
                    tenant = r.run.tenant
                    if by_tenant.get(tenant, 0) >= share or taken.get(r.run.run_id, 0) >= max(
                        1, share // tenants[tenant]
                    ):
                        continue
                take(r)
    return list(chosen.values())
