"""Programs: templates with semantic variables, calls, and the DAG they form. Pure, no I/O."""

from __future__ import annotations

from .call import Call
from .dag import Program, call_node, var_node
from .errors import (
    CycleError,
    DuplicateCallError,
    DuplicateProducerError,
    MissingInputError,
    ProgramError,
    TemplateError,
    UnknownVariableError,
)
from .generation import GenerationConfig
from .spec import AnyCallSpec, CallSpec, ChatCallSpec, ChatMessage, Criterion, ProgramSpec, RunSpec
from .template import InputRef, OutputRef, Segment, Text, parse, render, unparse
from .variable import SemanticVariable

__all__ = [
    "AnyCallSpec",
    "Call",
    "CallSpec",
    "ChatCallSpec",
    "ChatMessage",
    "Criterion",
    "CycleError",
    "DuplicateCallError",
    "DuplicateProducerError",
    "GenerationConfig",
    "InputRef",
    "MissingInputError",
    "OutputRef",
    "Program",
    "ProgramError",
    "ProgramSpec",
    "RunSpec",
    "Segment",
    "SemanticVariable",
    "TemplateError",
    "Text",
    "UnknownVariableError",
    "call_node",
    "parse",
    "render",
    "unparse",
    "var_node",
]
