"""`@semantic_function`: a Python function whose body is a prompt template.

    @semantic_function(max_tokens=64)
    def write_code(task):
        \"\"\"You are an expert software engineer. Write python code of {{input:task}}.
        Code: {{output:code}}\"\"\"

    code = write_code("a snake game")          # a SemanticVariable; nothing runs yet
    test = write_test(task="a snake game", code=code)
    print(test.get(perf="latency"))            # submits both calls as one run and waits

The template is the docstring (or the `template` argument). Its inputs are the function's
parameters, by name; its outputs are declared as `{{output:name}}`. Calling the function
returns one handle per output (a tuple when there are several, in template order).

Generation config: keyword arguments of the decorator that are `GenerationConfig` fields
(max_tokens, temperature, stop, ...) apply to every output; `outputs={"code": {...}}` sets
one output's config, over the shared one.
"""

from __future__ import annotations

import inspect
import re
import textwrap
from collections.abc import Callable
from typing import Any, overload

from parrot_backend.program import (
    GenerationConfig,
    InputRef,
    OutputRef,
    ProgramError,
    Segment,
    Text,
    parse,
    unparse,
)

from .session import SemanticVariable, as_value, current_session

_FIELDS = set(GenerationConfig.model_fields)


class SemanticFunction:
    """A prompt template bound to a Python signature; calling it builds a call lazily."""

    def __init__(
        self,
        fn: Callable[..., Any],
        template: str | None,
        shared: dict[str, Any],
        outputs: dict[str, dict[str, Any]],
    ) -> None:
        self.fn = fn
        # call and variable names derive from it: keep it a legal variable name
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", fn.__name__)
        self.name = name if re.match(r"[A-Za-z_]", name) else f"_{name}"
        source = template if template is not None else inspect.getdoc(fn)
        if not source:
            raise ProgramError(f"semantic function {self.name!r} has no template (docstring)")
        self.template = textwrap.dedent(source).strip()
        self.segments: list[Segment] = parse(self.template)
        self.signature = inspect.signature(fn)
        inputs = {s.name for s in self.segments if isinstance(s, InputRef)}
        self.outputs = [s.name for s in self.segments if isinstance(s, OutputRef)]
        params = set(self.signature.parameters)
        if not self.outputs:
            raise ProgramError(f"semantic function {self.name!r} has no {{{{output:...}}}}")
        if inputs - params:
            raise ProgramError(
                f"semantic function {self.name!r}: template inputs {sorted(inputs - params)} "
                "are not parameters"
            )
        if params - inputs:
            raise ProgramError(
                f"semantic function {self.name!r}: parameters {sorted(params - inputs)} "
                "are not used in the template"
            )
        unknown = set(outputs) - set(self.outputs)
        if unknown:
            raise ProgramError(f"configs for outputs not in the template: {sorted(unknown)}")
        self.configs = {
            o: GenerationConfig(**{**shared, **outputs.get(o, {})}) for o in self.outputs
        }

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Add a call to the current session; returns its output handle(s)."""
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        session = current_session()
        call = session.fresh_name(self.name)
        names: dict[str, str] = {}
        constants: dict[str, str] = {}
        for param, arg in bound.arguments.items():
            value = as_value(arg)
            if isinstance(value, SemanticVariable):
                if value.session is not session:
                    raise ValueError(f"{value!r} belongs to another session")
                names[param] = value.name
            else:
                names[param] = f"{call}.{param}"
                constants[names[param]] = value
        for out in self.outputs:
            names[out] = f"{call}.{out}"
        renamed = [_rename(seg, names) for seg in self.segments]
        configs = {names[o]: c for o, c in self.configs.items()}
        session.add_call(call, unparse(renamed), configs, constants)
        handles = tuple(SemanticVariable(names[o], session) for o in self.outputs)
        return handles[0] if len(handles) == 1 else handles

    def __repr__(self) -> str:
        return f"<semantic function {self.name}{self.signature}>"


def _rename(seg: Segment, names: dict[str, str]) -> Segment:
    if isinstance(seg, Text):
        return seg
    return type(seg)(names[seg.name])


@overload
def semantic_function(fn: Callable[..., Any], /) -> SemanticFunction: ...


@overload
def semantic_function(
    template: str | None = None,
    /,
    *,
    outputs: dict[str, dict[str, Any]] | None = None,
    **config: Any,
) -> Callable[[Callable[..., Any]], SemanticFunction]: ...


def semantic_function(
    fn_or_template: Callable[..., Any] | str | None = None,
    /,
    *,
    outputs: dict[str, dict[str, Any]] | None = None,
    **config: Any,
) -> Any:
    """Decorate a function whose docstring (or `template`) is a prompt template.

    Use bare (`@semantic_function`) or with a template and/or generation config
    (`@semantic_function(max_tokens=64, outputs={"code": {"stop": ["\\n\\n"]}})`).
    """
    unknown = set(config) - _FIELDS
    if unknown:
        raise TypeError(
            f"unknown generation settings {sorted(unknown)}; per-output configs go in outputs="
        )
    if callable(fn_or_template):
        return SemanticFunction(fn_or_template, None, config, outputs or {})

    def wrap(fn: Callable[..., Any]) -> SemanticFunction:
        return SemanticFunction(fn, fn_or_template, config, outputs or {})

    return wrap
