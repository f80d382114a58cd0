"""Task groups: parallel calls that feed the same consumer and should finish together.

When a call reads variables from two or more producers that do not depend on one another
(the *frontier*: producers that are not ancestors of another producer of the same call),
those producers form a **task group**: the consumer starts only when the last of them
finishes, so they should finish together. The scheduler gang-schedules a group (all its
queued members in one round or none: `policy.py`, `dispatch_window.py`) and batches it
for throughput; the group as a whole carries its consumer's objective (latency if any
consumer that formed it is latency). Map-reduce maps, and the agents of a multi-agent
fan-out/fan-in, are task groups. Groups that share a member are merged, so a call belongs
to at most one group.

A producer that is an ancestor of another producer of the same consumer is left out of the
group: it finishes before its descendant anyway, so finishing "together" means nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from parrot_backend.program import Criterion, Program


@dataclass(slots=True, frozen=True)
class TaskGroup:
    """Parallel calls that feed the same consumer(s) and should finish together."""

    id: int
    members: tuple[str, ...]  # call names, in program order
    consumers: tuple[str, ...]  # the fan-in calls that formed the group
    objective: Criterion


def task_groups(
    program: Program, preds: Mapping[str, list[str]], latency: set[str]
) -> list[TaskGroup]:
    """The task groups of `program`, given each call's distinct producers (`preds`) and
    the latency calls: the frontier producers of every fan-in call, unioned."""
    parent: dict[str, str] = {}

    def root(call: str) -> str:
        while parent[call] != call:
            parent[call] = parent[parent[call]]  # path halving keeps later finds short
            call = parent[call]
        return call

    consumers: dict[str, list[str]] = {}  # a member of each group -> its consumers
    for consumer, producers in preds.items():
        if len(producers) < 2:
            continue
        # every ancestor of any producer: a producer found here is upstream of another
        upstream: set[str] = set()
        stack = [q for p in producers for q in preds[p]]
        while stack:
            call = stack.pop()
            if call not in upstream:
                upstream.add(call)
                stack.extend(preds[call])
        frontier = [p for p in producers if p not in upstream]
        if len(frontier) < 2:
            continue
        for p in frontier:
            parent.setdefault(p, p)
        first = root(frontier[0])
        for p in frontier[1:]:
            other = root(p)
            if other != first:
                parent[other] = first
        consumers.setdefault(frontier[0], []).append(consumer)

    if not parent:
        return []

    order = {name: i for i, name in enumerate(program.calls)}
    members: dict[str, list[str]] = {}
    for call in sorted(parent, key=order.__getitem__):
        members.setdefault(root(call), []).append(call)
    formed_by: dict[str, list[str]] = {}
    for member, fan_ins in consumers.items():
        formed_by.setdefault(root(member), []).extend(fan_ins)

    groups: list[TaskGroup] = []
    for gid, (key, calls) in enumerate(sorted(members.items(), key=lambda kv: order[kv[1][0]])):
        fan_ins = tuple(sorted(set(formed_by[key]), key=order.__getitem__))
        objective: Criterion = "latency" if any(c in latency for c in fan_ins) else "throughput"
        groups.append(TaskGroup(gid, tuple(calls), fan_ins, objective))
    return groups
