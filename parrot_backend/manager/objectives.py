"""Objective deduction: per-call performance objectives from the application's end-to-end goal.

A client waits for some variables with a criterion, `latency` or `throughput` (a run's
declared outputs, or a `get(perf=...)`). From those, walking the DAG backwards:

1. **Latency flows upstream.** The producer of a variable waited for with `latency` is a
   latency call, and so is every call it (transitively) depends on: the value cannot be
   ready before all of them finish, so each one is on its critical path. In particular a
   latency call's sole producer inherits latency.
2. **Fan-in forms task groups** (`task_groups.py`): parallel producers of one call should
   finish together; a group carries its consumer's objective (latency if any consumer
   that formed it is latency), and its members are batched for throughput.
3. **Everything else is throughput.** Calls nobody waits on, directly or downstream, and
   calls feeding only throughput outputs, get `throughput`.

The deduction is a pure function of the program and the waits; an open run calls it again
when calls are added or a client starts waiting.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from parrot_backend.program import Call, Criterion, Program, UnknownVariableError

from .task_groups import TaskGroup, task_groups


@dataclass(slots=True, frozen=True)
class CallObjective:
    """The deduced objective of one call and the task group it belongs to, if any."""

    objective: Criterion
    group: int | None = None


@dataclass(slots=True)
class Deduction:
    """Objectives of every call of a program, and its task groups (ids index `groups`)."""

    calls: dict[str, CallObjective]
    groups: list[TaskGroup]
    _json: dict[str, dict[str, Any]] | None = field(default=None, repr=False, compare=False)

    def as_json(self) -> dict[str, dict[str, Any]]:
        """Each call's objective and group as JSON (the `objectives` event's `calls`),
        made once per deduction: read-only, as deductions are."""
        if self._json is None:
            self._json = {
                n: {"objective": c.objective, "group": c.group} for n, c in self.calls.items()
            }
        return self._json

    def group_of(self, call: str) -> TaskGroup | None:
        """The task group of `call`, or None."""
        gid = self.calls[call].group
        return None if gid is None else self.groups[gid]


# CallObjective is frozen: deductions share instances (runs keep one per call)
_PLAIN = {c: CallObjective(c) for c in ("latency", "throughput")}
_GROUPED: dict[tuple[Criterion, int], CallObjective] = {}


def _grouped(objective: Criterion, group: int) -> CallObjective:
    found = _GROUPED.get((objective, group))
    if found is None:
        found = CallObjective(objective, group)
        if group < 1024:  # bounded: group ids count from 0 in every program
            _GROUPED[(objective, group)] = found
    return found


def deduce(program: Program, waits: Mapping[str, Criterion]) -> Deduction:
    """Deduce each call's objective from the variables clients wait for.

    Raises UnknownVariableError for a waited name that is not a variable of `program`.
    """
    unknown = [name for name in waits if name not in program.variables]
    if unknown:
        raise UnknownVariableError(
            f"waiting for unknown variables: {', '.join(map(repr, unknown))}"
        )
    # the call graph as plain lists: each call's distinct producers (its predecessors)
    variables = program.variables
    preds: dict[str, list[str]] = {}
    for name, call in program.calls.items():
        found = [p for v in call.inputs if (p := variables[v].producer) is not None]
        preds[name] = found if len(found) < 2 else list(dict.fromkeys(found))
    latency = _latency_calls(program, preds, waits)
    groups = task_groups(program, preds, latency)
    calls = {name: _PLAIN["latency" if name in latency else "throughput"] for name in preds}
    for group in groups:
        for member in group.members:
            calls[member] = _grouped(calls[member].objective, group.id)
    return Deduction(calls, groups)


# Runs of one workflow share their `Call`s (the manager's CallBuilder), so the same calls
# with the same waits deduce the same objectives: the deduction is computed once per
# (calls, waits) and shared. Keyed by the calls' identities; the entry holds the calls, so
# an id cannot be reused while cached. Deductions handed out are shared: never mutate one.
_DEDUCED: dict[tuple[Any, ...], tuple[tuple[Call, ...], Deduction]] = {}
_DEDUCED_SIZE = 4096


def deduce_shared(program: Program, waits: Mapping[str, Criterion]) -> Deduction:
    """`deduce(program, waits)`, shared with earlier programs made of the same `Call`
    objects, in the same order, under the same waits (do not mutate the result)."""
    calls = tuple(program.calls.values())
    key = (tuple(map(id, calls)), tuple(waits.items()))
    hit = _DEDUCED.get(key)
    if hit is not None and len(hit[0]) == len(calls) and all(map(operator.is_, hit[0], calls)):
        return hit[1]
    deduction = deduce(program, waits)
    if len(_DEDUCED) >= _DEDUCED_SIZE:
        _DEDUCED.clear()
    _DEDUCED[key] = (calls, deduction)
    return deduction


def _latency_calls(
    program: Program, preds: Mapping[str, list[str]], waits: Mapping[str, Criterion]
) -> set[str]:
    """Producers of latency-waited variables and all their ancestors."""
    stack = [
        producer
        for name, criterion in waits.items()
        if criterion == "latency" and (producer := program.variables[name].producer) is not None
    ]
    seen: set[str] = set()
    while stack:
        call = stack.pop()
        if call not in seen:
            seen.add(call)
            stack.extend(preds[call])
    return seen
