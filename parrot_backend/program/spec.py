"""The JSON form of programs and runs, shared by the HTTP API and the SQL store.

Pydantic checks types and ranges (a ValidationError, i.e. a 422); `build` then parses
templates and checks the structure (a ProgramError, i.e. a 400 naming the offenders).
`ProgramSpec.model_json_schema()` is the published schema.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from .call import Call
from .dag import Program
from .errors import ProgramError
from .generation import GenerationConfig
from .template import NAME_PATTERN, is_valid_name
from .text import MAX_NAME_LENGTH, StorableModel

__all__ = [
    "AnyCallSpec",
    "CallSpec",
    "ChatCallSpec",
    "ChatMessage",
    "Criterion",
    "GenerationConfig",
    "ProgramSpec",
    "RunSpec",
]

Criterion = Literal["latency", "throughput"]


class ChatMessage(BaseModel):
    """One message of a chat call; `content` is a template (`{{input:x}}`, and in the
    final assistant message the `{{output:y}}` the call generates)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "developer", "user", "assistant"]
    content: str


class CallSpec(BaseModel):
    """One call: a template and the generation config of its outputs.

    Outputs of the template missing from `outputs` get the default config; names in
    `outputs` that the template does not generate are an error. An unnamed call is named
    `#<index>` after its place in the program (user names cannot start with `#`).
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str | None = Field(None, pattern=f"^{NAME_PATTERN}$", max_length=MAX_NAME_LENGTH)
    template: str
    outputs: dict[str, GenerationConfig] = Field(default_factory=dict)
    messages: ClassVar[None] = None  # (a ChatCallSpec has messages instead)

    def build(self, index: int) -> Call:
        """The parsed call; `index` names it when it has no name."""
        name = self.name if self.name is not None else f"#{index}"
        return Call.from_template(name, self.template, self.outputs)


class ChatCallSpec(BaseModel):
    """A chat call: `messages` instead of a template, the last one the assistant turn it
    generates (`{"role": "assistant", "content": "{{output:y}}"}`). The server renders
    them with the served model's chat template into a plain template
    (`server/native_chat.py`) before the program is built or stored."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str | None = Field(None, pattern=f"^{NAME_PATTERN}$", max_length=MAX_NAME_LENGTH)
    messages: list[ChatMessage] = Field(min_length=1)
    outputs: dict[str, GenerationConfig] = Field(default_factory=dict)
    template: ClassVar[None] = None  # (rendered into a CallSpec's template)

    def build(self, index: int) -> Call:
        """Refused: chat calls are built once the server has rendered them."""
        name = self.name if self.name is not None else f"#{index}"
        raise ProgramError(
            f"call {name!r}: chat messages must be rendered with the model's chat "
            "template first (the server does this when the program is submitted)"
        )


def _call_kind(value: object) -> str:
    if isinstance(value, dict):
        return "chat" if "messages" in value and "template" not in value else "template"
    return "chat" if isinstance(value, ChatCallSpec) else "template"


# A call is a template call or a chat call, told apart by its fields (errors then name
# the fields of the kind it is, and the published schema says one of the two).
AnyCallSpec = Annotated[
    Annotated[CallSpec, Tag("template")] | Annotated[ChatCallSpec, Tag("chat")],
    Discriminator(_call_kind),
]


class ProgramSpec(BaseModel):
    """Calls whose templates connect through semantic variables.

    `public` lets the program's prefixes be shared across tenants (cache hits are
    observable by timing, so sharing is opt-in).
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    calls: list[AnyCallSpec] = Field(min_length=1)
    public: bool = False

    def build(self) -> Program:
        """Parse every template and check the structure; raises a ProgramError subclass."""
        calls = [spec.build(i) for i, spec in enumerate(self.calls)]
        return Program(calls, public=self.public)


def check_names(names: dict[str, object]) -> dict[str, object]:
    """Raise ValueError unless every key is a variable name the store can hold."""
    bad = [n for n in names if not is_valid_name(n)]
    if bad:
        raise ValueError(
            f"invalid variable name(s) {', '.join(repr(n[:40]) for n in bad[:5])}: names match "
            f"{NAME_PATTERN} and are at most {MAX_NAME_LENGTH} characters"
        )
    return names


class RunSpec(StorableModel):
    """A program run: input values and the outputs a client waits for, with its criterion.

    An `open` run accepts more calls and inputs later: missing inputs, and names of
    variables that no call mentions yet, are allowed until it closes.
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    program: ProgramSpec
    inputs: dict[str, str] = Field(default_factory=dict)
    outputs: dict[str, Criterion] = Field(default_factory=dict)
    open: bool = False

    @model_validator(mode="after")
    def _open_run_names(self) -> RunSpec:
        # a closed run names only variables of its program (`check_run`); an open run may
        # name variables of calls it adds later, which become rows of the store now
        if self.open:
            check_names(self.inputs)
            check_names(self.outputs)
        return self

    def build(self) -> Program:
        """The program, checked against this run's inputs and outputs."""
        program = self.program.build()
        program.check_run(self.inputs, self.outputs, closed=not self.open)
        return program
