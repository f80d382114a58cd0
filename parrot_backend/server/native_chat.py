"""Chat calls of native programs, rendered into plain templates with the model's chat template.

A call may give `messages` (role + content; contents are templates) instead of a template;
the last message is the assistant turn it generates. The messages are rendered by the
served model's chat template (in the sandbox of `chat_template.py`, as the OpenAI chat
route does) with a sentinel in place of every placeholder, and the rendered text is split
at the sentinels back into segments: the result is a plain template, so prefix sharing,
objective deduction and storage treat a chat call like any other. A system prompt shared
by many chat calls becomes a shared static prefix.

Values stay data: they are substituted when a call runs, into a template whose chat
markup is already fixed, so no value can close a role or open another (and values are
never parsed as placeholders either).
"""

from __future__ import annotations

from typing import Any

from parrot_backend.program import CallSpec, ChatCallSpec, ProgramSpec, RunSpec, TemplateError
from parrot_backend.program.template import InputRef, OutputRef, Segment, Text, parse, unparse

from .chat_template import ChatTemplateError, render_chat

# Private-use code points bracket a placeholder's number: chat templates pass content
# through as text, and no real message holds these.
_OPEN, _CLOSE = "\ue000", "\ue001"


class ChatCallError(ValueError):
    """A chat call that cannot be rendered (bad messages or a failing chat template)."""


def lower_program(
    program: ProgramSpec, chat_template: str | None, special_tokens: dict[str, str]
) -> ProgramSpec:
    """`program` with every chat call rendered into a template (the same object when it
    has none)."""
    if not any(isinstance(c, ChatCallSpec) for c in program.calls):
        return program
    calls = [lower_call(c, chat_template, special_tokens, i) for i, c in enumerate(program.calls)]
    return program.model_copy(update={"calls": calls})


def lower_run(spec: RunSpec, chat_template: str | None, special_tokens: dict[str, str]) -> RunSpec:
    """`spec` with its program's chat calls rendered."""
    program = lower_program(spec.program, chat_template, special_tokens)
    return spec if program is spec.program else spec.model_copy(update={"program": program})


def lower_calls(
    calls: list[CallSpec | ChatCallSpec],
    chat_template: str | None,
    special_tokens: dict[str, str],
    first: int,
) -> list[CallSpec]:
    """Calls added to an open run, chat calls rendered (`first`: the first one's index)."""
    return [lower_call(c, chat_template, special_tokens, first + i) for i, c in enumerate(calls)]


def lower_call(
    call: CallSpec | ChatCallSpec,
    chat_template: str | None,
    special_tokens: dict[str, str],
    index: int,
) -> CallSpec:
    """One call, its messages (if any) rendered into a template."""
    if not isinstance(call, ChatCallSpec):
        return call
    name = call.name if call.name is not None else f"#{index}"
    refs: list[InputRef | OutputRef] = []
    messages: list[dict[str, Any]] = []
    *earlier, last = call.messages
    if last.role != "assistant":
        raise ChatCallError(
            f"call {name!r}: the last message must be the assistant turn the "
            'call generates, e.g. {"role": "assistant", "content": '
            '"{{output:answer}}"}'
        )
    for i, message in enumerate(earlier):
        segments = _parse(name, i, message.content)
        if any(isinstance(s, OutputRef) for s in segments):
            raise ChatCallError(
                f"call {name!r}, message {i}: only the last (assistant) "
                "message may hold {{output:...}}"
            )
        messages.append({"role": message.role, "content": _with_sentinels(segments, refs)})
    final = _parse(name, len(earlier), last.content)
    if not any(isinstance(s, OutputRef) for s in final):
        raise ChatCallError(
            f"call {name!r}: the assistant message generates nothing; give it "
            "an {{output:NAME}}"
        )
    try:
        prompt = render_chat(
            chat_template, messages, add_generation_prompt=True, special_tokens=special_tokens
        )
    except ChatTemplateError as exc:
        raise ChatCallError(f"call {name!r}: {exc}") from None
    segments = _from_sentinels(name, prompt, refs) + final
    return CallSpec(name=call.name, template=unparse(segments), outputs=call.outputs)


def _parse(name: str, index: int, content: str) -> list[Segment]:
    try:
        return parse(content)
    except TemplateError as exc:
        raise ChatCallError(f"call {name!r}, message {index}: {exc}") from None


def _with_sentinels(segments: list[Segment], refs: list[InputRef | OutputRef]) -> str:
    parts = []
    for seg in segments:
        if isinstance(seg, Text):
            if _OPEN in seg.text or _CLOSE in seg.text:
                raise ChatCallError("message text holds reserved characters U+E000/U+E001")
            parts.append(seg.text)
        else:
            parts.append(f"{_OPEN}{len(refs)}{_CLOSE}")
            refs.append(seg)
    return "".join(parts)


def _from_sentinels(name: str, text: str, refs: list[InputRef | OutputRef]) -> list[Segment]:
    """Split the rendered prompt at the sentinels back into text and placeholders; every
    placeholder must come back exactly once (a template that drops or repeats a message's
    content cannot be used for a chat call)."""
    out: list[Segment] = []
    seen: list[int] = []
    pos = 0
    while (start := text.find(_OPEN, pos)) >= 0:
        end = text.find(_CLOSE, start)
        number = text[start + 1 : end] if end > start else ""
        if not number.isdigit() or int(number) >= len(refs):
            raise ChatCallError(f"call {name!r}: the chat template altered a placeholder")
        if start > pos:
            out.append(Text(text[pos:start]))
        out.append(refs[int(number)])
        seen.append(int(number))
        pos = end + 1
    if pos < len(text):
        out.append(Text(text[pos:]))
    if sorted(seen) != list(range(len(refs))):
        raise ChatCallError(
            f"call {name!r}: the chat template dropped or repeated a message's placeholders"
        )
    return out
