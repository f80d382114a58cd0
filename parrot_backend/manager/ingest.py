"""Building programs from their JSON specs, with parsed templates cached.

`RunSpec.build()` parses every template of every run; runs of one workflow repeat the
same templates, so the manager parses each distinct template once. A cache miss (or a
spec the cached parse cannot serve) goes through `Call.from_template`, so errors are the
program package's own.

A built `Call` is never changed afterwards (programs add and remove whole calls), so runs
of one workflow share the `Call` of a call that has the same name and template and gives
no generation configs of its own (the common case: every output takes the defaults).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from parrot_backend.program import Call, CallSpec, GenerationConfig, Program, RunSpec, Segment

_DEFAULT = GenerationConfig()  # shared: configs are never mutated after validation


class CallBuilder:
    """Builds `Call`s from `CallSpec`s, remembering the segments of recent templates."""

    def __init__(self, size: int = 4096) -> None:
        self._size = size
        self._segments: OrderedDict[str, tuple[tuple[Segment, ...], frozenset[str]]] = OrderedDict()
        self._plain: OrderedDict[tuple[str, str], Call] = OrderedDict()  # default configs

    def call(self, spec: CallSpec, index: int) -> Call:
        """The call of `spec`, named `#<index>` when unnamed (as `CallSpec.build`).

        Shared with earlier runs when equal: do not mutate it."""
        name = spec.name if spec.name is not None else f"#{index}"
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
        """What `spec.build()` returns: the program, checked against the run's inputs."""
        program = Program(self.calls(spec.program.calls), public=spec.program.public)
        program.check_run(spec.inputs, spec.outputs, closed=not spec.open)
        return program
