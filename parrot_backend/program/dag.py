"""Program: calls and semantic variables as a DAG, with the structural checks."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator
from typing import Literal

import networkx as nx

from .call import Call
from .errors import (
    CycleError,
    DuplicateCallError,
    DuplicateProducerError,
    MissingInputError,
    ProgramError,
    UnknownVariableError,
)
from .variable import SemanticVariable

Node = tuple[Literal["call", "var"], str]


def call_node(name: str) -> Node:
    """The graph node of call `name`."""
    return ("call", name)


def var_node(name: str) -> Node:
    """The graph node of semantic variable `name`."""
    return ("var", name)


class Program:
    """Calls and semantic variables. Acyclic, and every variable has at most one producer.

    `graph` is bipartite: edges go variable -> call (the call reads it) and call ->
    variable (the call generates it). Nodes are `("call", name)` and `("var", name)`
    because a call and a variable may share a name. `public` marks the program's prefixes
    as shareable across tenants.

    The structure itself lives in `calls` (each call's inputs and outputs) and
    `variables` (each variable's producer and consumers); `graph` is a networkx view of
    it, built on first use after a change (the manager's hot paths never need one).

    Calls can be added later (`add_call`), as an open run does; each addition is checked
    and leaves the program unchanged when it fails.
    """

    def __init__(self, calls: Iterable[Call] = (), public: bool = False) -> None:
        self.calls: dict[str, Call] = {}
        self.variables: dict[str, SemanticVariable] = {}
        self._graph: nx.DiGraph | None = None
        self.public = public
        self.add_calls(calls)

    @property
    def graph(self) -> nx.DiGraph:
        """The bipartite variable/call graph (see the class doc); do not mutate it."""
        if self._graph is None:
            g = nx.DiGraph()
            for call in self.calls.values():
                node = call_node(call.name)
                g.add_node(node)
                for name in call.inputs:
                    g.add_edge(var_node(name), node)
                for name in call.outputs:
                    g.add_edge(node, var_node(name))
            self._graph = g
        return self._graph

    def add_call(self, call: Call) -> None:
        """Add one call; see `add_calls`."""
        self.add_calls([call])

    def add_calls(self, calls: Iterable[Call]) -> None:
        """Add calls, checking names, producers and cycles over the whole batch.

        Raises DuplicateCallError, DuplicateProducerError or CycleError naming every
        offender; on error the program is unchanged.
        """
        calls = list(calls)
        self._check_new(calls)
        self._graph = None
        for call in calls:
            self._insert(call)
        cycle = self._find_cycle([c.name for c in calls])
        if cycle is None:
            return
        for call in reversed(calls):
            self._remove(call)
        raise CycleError(*cycle)

    def _find_cycle(self, sources: list[str]) -> tuple[list[str], list[str]] | None:
        """A cycle reachable from the calls `sources`, as its calls in order and the
        variable each passes to the next, or None.

        The program was acyclic before, so any new cycle passes through a new call and is
        reachable from it; searching only from there keeps adding a call to a large open
        run cheap. The search walks `graph` depth first (a variable has one producer, so
        it is entered only from there: a cycle closes at a call).
        """
        done: set[str] = set()
        on_path: dict[str, int] = {}  # call -> its index in `path`
        path: list[str] = []
        via: list[str] = []  # via[i]: the variable path[i] passes to path[i + 1]
        for source in sources:
            if source in done:
                continue
            stack = [self._edges(source)]
            on_path[source] = 0
            path.append(source)
            while stack:
                edge = next(stack[-1], None)
                if edge is None:
                    stack.pop()
                    node = path.pop()
                    del on_path[node]
                    done.add(node)
                    if via:
                        via.pop()
                    continue
                var, child = edge
                if child in on_path:
                    k = on_path[child]
                    return path[k:], [*via[k:], var]
                if child not in done:
                    on_path[child] = len(path)
                    path.append(child)
                    via.append(var)
                    stack.append(self._edges(child))
        return None

    def _edges(self, call: str) -> Iterator[tuple[str, str]]:
        """(variable, consumer) for each output of `call` and each call reading it."""
        variables = self.variables
        return ((out, c) for out in self.calls[call].outputs for c in variables[out].consumers)

    def _check_new(self, calls: list[Call]) -> None:
        problems: list[str] = []
        names: set[str] = set()
        for call in calls:
            if call.name in self.calls or call.name in names:
                problems.append(f"call name {call.name!r} is used twice")
            names.add(call.name)
        if problems:
            raise DuplicateCallError("; ".join(problems), problems)
        producer: dict[str, list[str]] = {}
        for call in calls:
            for out in call.outputs:
                producer.setdefault(out, []).append(call.name)
        for var, new in producer.items():
            old = self.variables.get(var)
            makers = ([old.producer] if old is not None and old.producer else []) + new
            if len(makers) > 1:
                problems.append(
                    f"variable {var!r} is produced by calls {', '.join(map(repr, makers))}"
                )
        if problems:
            raise DuplicateProducerError("; ".join(problems), problems)

    def _insert(self, call: Call) -> None:
        self.calls[call.name] = call
        for name in call.inputs:
            self._variable(name).consumers.append(call.name)
        for name in call.outputs:
            self._variable(name).producer = call.name

    def _remove(self, call: Call) -> None:
        del self.calls[call.name]
        self._graph = None
        for name in (*call.inputs, *call.outputs):
            var = self.variables[name]
            if var.producer == call.name:
                var.producer = None
            if call.name in var.consumers:
                var.consumers.remove(call.name)
            if var.producer is None and not var.consumers:
                del self.variables[name]

    def _variable(self, name: str) -> SemanticVariable:
        var = self.variables.get(name)
        if var is None:
            var = self.variables[name] = SemanticVariable(name)
        return var

    @property
    def inputs(self) -> list[str]:
        """Variables that no call produces: the run provides them."""
        return [v.name for v in self.variables.values() if v.is_input]

    def producers(self, call: str) -> list[str]:
        """Distinct calls that produce the inputs of `call`, in input order."""
        found = (self.variables[v].producer for v in self.calls[call].inputs)
        return list(dict.fromkeys(p for p in found if p is not None))

    def consumers(self, call: str) -> list[str]:
        """Distinct calls that read an output of `call`."""
        found = (c for v in self.calls[call].outputs for c in self.variables[v].consumers)
        return list(dict.fromkeys(found))

    def call_graph(self) -> nx.DiGraph:
        """Calls only: an edge producer -> consumer for each variable passed between them."""
        g = nx.DiGraph()
        g.add_nodes_from(self.calls)
        for var in self.variables.values():
            if var.producer is not None:
                for consumer in var.consumers:
                    g.add_edge(var.producer, consumer)
        return g

    def topological_calls(self) -> list[str]:
        """Call names, each after every call it depends on."""
        return [name for kind, name in nx.topological_sort(self.graph) if kind == "call"]

    def check_run(
        self,
        inputs: Collection[str],
        outputs: Collection[str] = (),
        closed: bool = True,
    ) -> None:
        """Check a run's input values and awaited outputs against this program.

        Inputs must not be produced by a call. A closed run must name only known
        variables and give every input; an open run may name variables of calls it will
        add later and give inputs later, so it is checked again when it closes. Raises
        UnknownVariableError, ProgramError or MissingInputError naming all offenders of
        the first kind found.
        """
        unknown = [n for n in (*inputs, *outputs) if n not in self.variables]
        if unknown and closed:
            msg = f"unknown variables: {', '.join(map(repr, dict.fromkeys(unknown)))}"
            raise UnknownVariableError(msg)
        produced = [
            n for n in inputs if n in self.variables and self.variables[n].producer is not None
        ]
        if produced:
            problems = [
                f"input {n!r} is produced by call {self.variables[n].producer!r}" for n in produced
            ]
            raise ProgramError("; ".join(problems), problems)
        if closed:
            given = set(inputs)
            missing = [n for n in self.inputs if n not in given]
            if missing:
                raise MissingInputError(f"inputs never provided: {', '.join(map(repr, missing))}")
