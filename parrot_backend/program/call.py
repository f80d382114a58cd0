"""A call: one template instance, an LLM request whose inputs and outputs are variables."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .errors import ProgramError, TemplateError
from .generation import GenerationConfig
from .template import Segment, input_names, output_names, parse


@dataclass(slots=True)
class Call:
    """A parsed template with a generation config for each of its outputs.

    A call with several outputs generates them in template order, in one context. Build
    one with `Call.from_template`, which parses and checks the configs.
    """

    name: str
    template: str
    segments: tuple[Segment, ...]
    configs: dict[str, GenerationConfig]
    inputs: tuple[str, ...] = field(init=False)
    outputs: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        self.inputs = tuple(input_names(self.segments))
        self.outputs = tuple(output_names(self.segments))

    @classmethod
    def from_template(
        cls,
        name: str,
        template: str,
        configs: Mapping[str, GenerationConfig] | None = None,
    ) -> Call:
        """Parse `template`; outputs without a config get the defaults.

        Raises TemplateError (naming this call) for a bad template and ProgramError for a
        config whose output is not in the template.
        """
        try:
            segments = tuple(parse(template))
        except TemplateError as e:
            raise TemplateError(e.reason, e.position, call=name) from None
        outs = output_names(segments)
        configs = dict(configs or {})
        unknown = [o for o in configs if o not in outs]
        if unknown:
            raise ProgramError(
                f"call {name!r}: configs for outputs not in its template: "
                f"{', '.join(map(repr, unknown))}"
            )
        full = {o: configs.get(o) or GenerationConfig() for o in outs}
        return cls(name, template, segments, full)
