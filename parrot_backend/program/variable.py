"""Semantic variables: the named text slots that connect calls."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SemanticVariable:
    """A named text slot of a program: produced by at most one call, read by any number.

    A variable with no producer is a program input; a run gives it a value. The value and
    its state (pending, ready, failed) live with the run, not here: a program is structure.
    """

    name: str
    producer: str | None = None
    consumers: list[str] = field(default_factory=list)

    @property
    def is_input(self) -> bool:
        """Whether the run must provide this variable's value (no call produces it)."""
        return self.producer is None
