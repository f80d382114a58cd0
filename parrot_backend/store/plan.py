"""Call descriptors: the plain data a run is created from (no dependency on program classes)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from parrot_backend.store.columns import OBJECTIVES
from parrot_backend.store.errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class CallDescriptor:
    """A validated call descriptor."""

    name: str | None
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    objective: str | None = None
    task_group: str | None = None


def _names(value: Any, what: str) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise InvalidRequestError(f"{what} must be a list of variable names")
    names = tuple(value)
    if not all(isinstance(n, str) and n for n in names):
        raise InvalidRequestError(f"{what} must hold non-empty strings")
    if len(set(names)) != len(names):
        raise InvalidRequestError(f"{what} repeats a name: {list(names)}")
    return names


def parse_calls(calls: Sequence[Mapping[str, Any]]) -> list[CallDescriptor]:
    """Validate descriptors ``{"name", "inputs": [...], "outputs": [...], "objective"?,
    "task_group"?}``; raise :class:`InvalidRequestError` on bad data."""
    plans = []
    for i, desc in enumerate(calls):
        if not isinstance(desc, Mapping):
            raise InvalidRequestError(f"call {i} must be a mapping")
        objective = desc.get("objective")
        if objective is not None and objective not in OBJECTIVES:
            raise InvalidRequestError(f"call {i}: objective must be one of {OBJECTIVES}")
        group = desc.get("task_group")
        plans.append(
            CallDescriptor(
                name=desc.get("name"),
                inputs=_names(desc.get("inputs", ()), f"call {i} inputs"),
                outputs=_names(desc.get("outputs", ()), f"call {i} outputs"),
                objective=objective,
                task_group=None if group is None else str(group),
            )
        )
    return plans


def check_producers(
    plans: Sequence[CallDescriptor],
    produced: Mapping[str, int],
    inputs: Iterable[str],
    first_idx: int,
) -> dict[str, int]:
    """Each variable has at most one producer and is not also a client input.

    ``produced`` maps variables already produced in the run to their call index; returns
    the new mapping including ``plans`` numbered from ``first_idx``.
    """
    result = dict(produced)
    given = set(inputs)
    for offset, plan in enumerate(plans):
        for out in plan.outputs:
            if out in result:
                raise InvalidRequestError(
                    f"variable {out!r} is produced by calls {result[out]} and {first_idx + offset}"
                )
            if out in given:
                raise InvalidRequestError(f"variable {out!r} is both an input and an output")
            result[out] = first_idx + offset
    return result
