"""Errors raised while parsing templates and checking programs.

All of them are `ValueError`s: they describe bad client input, which the server
turns into a 4xx answer carrying the message.
"""

from __future__ import annotations


class ProgramError(ValueError):
    """A program (or run) is malformed. `problems` lists every offender found."""

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems: list[str] = problems if problems is not None else [message]


class TemplateError(ProgramError):
    """A template does not parse. `position` is the 0-based character offset of the fault.

    `call` names the call whose template failed, when the error comes from a program.
    """

    def __init__(self, message: str, position: int, call: str | None = None) -> None:
        where = f"call {call!r}: " if call is not None else ""
        super().__init__(f"{where}{message} (at position {position})")
        self.reason = message
        self.position = position
        self.call = call


class CycleError(ProgramError):
    """The calls depend on each other in a loop.

    `cycle` is the loop as call names; `via[i]` is the variable call `cycle[i]` produces
    and the next call in the loop reads.
    """

    def __init__(self, cycle: list[str], via: list[str]) -> None:
        steps = [f"{call!r} -({var})-> " for call, var in zip(cycle, via, strict=True)]
        super().__init__(f"calls form a cycle: {''.join(steps)}{cycle[0]!r}")
        self.cycle = cycle
        self.via = via


class DuplicateProducerError(ProgramError):
    """A semantic variable is an output of more than one call."""


class DuplicateCallError(ProgramError):
    """Two calls have the same name."""


class MissingInputError(ProgramError):
    """An input variable that no call produces was never given a value."""


class UnknownVariableError(ProgramError):
    """A run names a variable (as an input value or an awaited output) the program lacks."""
