"""Building programs from their JSON specs, with parsed templates cached.

`RunSpec.build()` parses every template of every run; runs of one workflow repeat the
same templates, so the manager parses each distinct template once. A cache miss (or a
spec the cached parse cannot serve) goes through `Call.from_template`, so errors are the
program package's own.

A built `Call` is never changed afterwards (programs add and remove whole calls), so runs
of one workflow share the `Call` of a call that has the same name and template and gives
no generation configs of its own (the common case: every output takes the defaults).

Closed runs of one workflow share their whole `Program` too (built and checked for
duplicate names, producers and cycles once): a closed run's program never changes (only
open runs add calls), so the program of a closed run is read-only. Open runs get their
own program, which `add_calls` changes. They also share the program's JSON form (what
the `run_created` event carries): read-only, as every event payload.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from parrot_backend.program import Call, CallSpec, GenerationConfig, Program, RunSpec, Segment

_DEFAULT = GenerationConfig()  # shared: configs are frozen


class CallBuilder:
    """Builds `Call`s from `CallSpec`s, remembering the segments of recent templates."""

    def __init__(self, size: int = 4096) -> None:
        self._size = size
        self._segments: OrderedDict[str, tuple[tuple[Segment, ...], frozenset[str]]] = OrderedDict()
        self._plain: OrderedDict[tuple[str, str], Call] = OrderedDict()  # default configs
        # closed programs whose calls all take default configs, by (public, names+templates)
        # ... with the JSON form and the set of the program's inputs
        self._programs: OrderedDict[
            tuple[bool, tuple[tuple[str | None, str], ...]],
            tuple[Program, dict[str, Any], frozenset[str]],
        ] = OrderedDict()

    def call(self, spec: CallSpec, index: int) -> Call:
        """The call of `spec`, named `#<index>` when unnamed (as `CallSpec.build`).

        Shared with earlier runs when equal: do not mutate it."""
        name = spec.name if spec.name is not None else f"#{index}"
        if spec.template is None:  # chat messages the server did not render
            return spec.build(index)  # (raises the ProgramError that says so)
        if spec.outputs:
            return self._build(name, spec)
        key = (name, spec.template)
        call = self._plain.get(key)
        if call is not None:
            self._plain.move_to_end(key)
            return call
        call = self._plain[key] = self._build(name, spec)
        if len(self._plain) > self._size:
            self._plain.popitem(last=False)
        return call

    def _build(self, name: str, spec: CallSpec) -> Call:
        hit = self._segments.get(spec.template)
        if hit is None or not hit[1].issuperset(spec.outputs):
            call = Call.from_template(name, spec.template, spec.outputs)
            self._segments[spec.template] = (call.segments, frozenset(call.outputs))
            if len(self._segments) > self._size:
                self._segments.popitem(last=False)
            return call
        self._segments.move_to_end(spec.template)
        segments, _ = hit
        call = Call(name, spec.template, segments, {})
        call.configs = {o: spec.outputs.get(o) or _DEFAULT for o in call.outputs}
        return call

    def calls(self, specs: Sequence[CallSpec], base: int = 0) -> list[Call]:
        """Calls for `specs`, unnamed ones numbered from `base`."""
        return [self.call(spec, base + i) for i, spec in enumerate(specs)]

    def program(self, spec: RunSpec) -> Program:
        """What `spec.build()` returns: the program, checked against the run's inputs.

        Shared with earlier closed runs of the same workflow when the run is closed and no
        call gives generation configs: do not mutate it (the module doc)."""
        return self.build(spec)[0]

    def build(self, spec: RunSpec) -> tuple[Program, dict[str, Any]]:
        """`program(spec)` and `spec.program.model_dump(mode="json")`, both shared with
        earlier closed runs of the same workflow where `program` shares the program:
        read-only (the module doc)."""
        specs = spec.program.calls
        key = None
        if not spec.open and not any(c.outputs for c in specs):
            key = (spec.program.public, tuple([(c.name, c.template) for c in specs]))
            hit = self._programs.get(key)
            if hit is not None:
                self._programs.move_to_end(key)
                program, dumped, inputs = hit
                # what check_run accepts: exactly the program's inputs given, and outputs
                # it has (it is asked only when not, for its error message)
                variables = program.variables
                if spec.inputs.keys() != inputs or not all(o in variables for o in spec.outputs):
                    program.check_run(spec.inputs, spec.outputs, closed=True)
                return program, dumped
        program = Program(self.calls(specs), public=spec.program.public)
        program.check_run(spec.inputs, spec.outputs, closed=not spec.open)
        dumped = spec.program.model_dump(mode="json")
        if key is not None:  # cached only once checked: a bad run's program is not kept
            self._programs[key] = program, dumped, frozenset(program.inputs)
            if len(self._programs) > self._size:
                self._programs.popitem(last=False)
        return program, dumped
