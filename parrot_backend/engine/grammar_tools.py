"""Tool calls as text: the format a model writes them in, the grammar that forces them, and
the parser that reads them back, whole or as a stream.

The format is the one Hermes-style chat templates (Qwen2.5, SmolLM3, Hermes) teach, and the
one `server/chat_template.py` describes to a model whose template knows no tools:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call. `tool_call_grammar` builds the Lark grammar (llguidance, with each
function's parameters inlined as a JSON schema) that admits only such blocks, so a forced
call always names a given function and its arguments always parse against its schema.
`ToolCallParser` turns text into content and calls incrementally: a call's name is known
as soon as it is written and its arguments are reported as they grow, which is what an
OpenAI stream sends (`delta.tool_calls`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .grammar import JSON_OPTIONS, closed

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
ARGUMENT_KEYS = ("arguments", "parameters")  # Llama-style templates say "parameters"

_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(arguments|parameters)"'
    r"\s*:\s*"
)


@dataclass(frozen=True, slots=True)
class Function:
    """A function the model may call: its name and the JSON schema of its arguments."""

    name: str
    parameters: dict[str, Any]


def call_schema(function: Function) -> dict[str, Any]:
    """The JSON schema of one call object of `function` (name first: streams learn it early)."""
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["name", "arguments"],
        "properties": {"name": {"const": function.name}, "arguments": closed(function.parameters)},
    }


def tool_call_grammar(
    functions: Sequence[Function],
    *,
    parallel: bool = True,
    content_schema: dict[str, Any] | None = None,
) -> str:
    """A Lark grammar of one tool call (or, with `parallel`, one or more) of `functions`.

    With `content_schema` the text may instead be JSON of that schema (a model that may
    answer or call, under a response format)."""
    if not functions:
        raise ValueError("a tool-call grammar needs at least one function")
    schema = (
        call_schema(functions[0])
        if len(functions) == 1
        else {"anyOf": [call_schema(f) for f in functions]}
    )
    schema = _spelled(schema)
    lines = [
        "calls: call" + (' ("\\n" call)*' if parallel else ""),
        f"call: {json.dumps(OPEN + chr(10))} body {json.dumps(chr(10) + CLOSE)}",
        f"body: %json {json.dumps(schema, ensure_ascii=False)}",
    ]
    if content_schema is None:
        lines.insert(0, "start: calls")
    else:
        lines.insert(0, "start: calls | content")
        content = json.dumps(_spelled(closed(content_schema)), ensure_ascii=False)
        lines.append(f"content: %json {content}")
    return "\n".join(lines) + "\n"


def _spelled(schema: dict[str, Any]) -> dict[str, Any]:
    # inline %json schemas take llguidance's JSON options from "x-guidance": the same
    # compact spelling as a response format (`grammar.JSON_OPTIONS`)
    return {"x-guidance": JSON_OPTIONS, **schema}


@dataclass(slots=True)
class ParsedCall:
    """A tool call read from text: `arguments` is the JSON text as the model wrote it."""

    name: str
    arguments: str = ""
    complete: bool = False


Event = tuple[str, int, str]  # ("content", -1, text) | ("call", index, name) | ("arguments",
# index, text): what a parser found, in the order of the text


def _held(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that could begin `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class _ValueScanner:
    """Finds where a JSON value written incrementally ends (it need not be valid JSON:
    braces and brackets are counted outside strings)."""

    __slots__ = ("depth", "in_string", "escaped", "started", "done")

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.started = False
        self.done = False

    def feed(self, text: str) -> int:
        """How many characters of `text` belong to the value (all, unless it ends)."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                    if self.depth == 0:
                        self.done = True
                        return i + 1
                continue
            if not self.started and ch.isspace():
                continue
            self.started = True
            if ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    self.done = True
                    return i + 1
            elif self.depth == 0 and ch in ",}\n":
                self.done = True  # a bare scalar ended
                return i
        return len(text)


class ToolCallParser:
    """Splits a model's text into content and tool calls, fed a delta at a time.

    Text that might begin a `<tool_call>` is held back until it is decided. Inside a block
    whose object starts with `"name"` the name is reported at once and the arguments as
    they come; any other block is read whole at its end. A block that does not parse stays
    content, tags and all (a model that wrote something call-like but not a call)."""

    def __init__(self) -> None:
        self.calls: list[ParsedCall] = []
        self.content: list[str] = []
        self._buf = ""
        self._state = "outside"  # outside | head | arguments | tail | raw
        self._scanner: _ValueScanner | None = None
        self._block = ""  # the whole block's text, for the raw path and for failures
        self._space = ""  # trailing whitespace of the content, held until text follows it

    def feed(self, text: str) -> list[Event]:
        """Take the next text delta; returns what it completed, in order."""
        events: list[Event] = []
        self._buf += text
        self._block += text if self._state != "outside" else ""
        progress = True
        while progress:
            progress = self._step(events)
        return events

    def finish(self) -> list[Event]:
        """At the end of the text: release held content; an unfinished block whose call
        started stays a (partial) call, one that never did becomes content (a block cut
        inside its opening tag after other calls is dropped)."""
        events: list[Event] = []
        if self._state == "outside":
            # after calls, a held-back "<tool_c" is the start of a block cut off by the
            # token budget, not content
            if not (self.calls and self._buf and OPEN.startswith(self._buf)):
                self._emit_content(events, self._buf)
        elif self._state in ("head", "raw"):
            self._emit_content(events, OPEN + self._block)
        elif self._state == "arguments":
            self._emit_arguments(events, self._buf)
        if self._space and not self.calls:
            self.content.append(self._space)
            events.append(("content", -1, self._space))
        self._buf = self._space = ""
        self._state = "outside"
        return events

    # ------------------------------------------------------------------ internals
    def _step(self, events: list[Event]) -> bool:
        if self._state == "outside":
            at = self._buf.find(OPEN)
            if at == -1:
                keep = _held(self._buf, OPEN)
                self._emit_content(events, self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep :]
                return False
            self._emit_content(events, self._buf[:at])
            self._buf = self._buf[at + len(OPEN) :]
            self._block = self._buf
            self._state = "head"
            return True
        if self._state == "head":
            match = _HEAD.match(self._buf)
            if match is None:
                if self._could_become_head(self._buf):
                    return False
                self._state = "raw"
                return True
            name = json.loads(match.group(1))
            self.calls.append(ParsedCall(name))
            events.append(("call", len(self.calls) - 1, name))
            self._buf = self._buf[match.end() :]
            self._scanner = _ValueScanner()
            self._state = "arguments"
            return True
        if self._state == "arguments":
            if not self._scanner.started:
                self._buf = self._buf.lstrip()  # the space after the colon is no argument
                if not self._buf:
                    return False
            used = self._scanner.feed(self._buf)
            self._emit_arguments(events, self._buf[:used])
            self._buf = self._buf[used:]
            if self._scanner.done:
                self.calls[-1].complete = True
                self._state = "tail"
                return True
            return False
        if self._state == "tail":
            at = self._buf.find(CLOSE)
            if at == -1:
                return False
            self._buf = self._buf[at + len(CLOSE) :]
            self._state = "outside"
            return True
        # raw: a block read whole once it closes
        at = self._block.find(CLOSE)
        if at == -1:
            return False
        body, self._buf = self._block[:at], self._block[at + len(CLOSE) :]
        self._state = "outside"
        call = _whole_call(body)
        if call is None:
            self._emit_content(events, OPEN + body + CLOSE)
        else:
            self.calls.append(call)
            index = len(self.calls) - 1
            events.append(("call", index, call.name))
            events.append(("arguments", index, call.arguments))
        return True

    @staticmethod
    def _could_become_head(text: str) -> bool:
        # a prefix of `{"name": "...", "arguments":` that is not yet complete
        probe = text.lstrip()
        target = '{"name"'
        compact = re.sub(r"\s+", "", probe)
        if len(compact) < len(target):
            return target.startswith(compact)
        return compact.startswith(target) and len(text) < 400

    def _emit_content(self, events: list[Event], text: str) -> None:
        # trailing whitespace is held: the line breaks around calls are not content, but
        # whitespace inside content (or ending a text with no calls) is
        text, self._space = self._space + text, ""
        body = text.rstrip()
        self._space = text[len(body) :]
        if body:
            self.content.append(body)
            events.append(("content", -1, body))

    def _emit_arguments(self, events: list[Event], text: str) -> None:
        if text:
            self.calls[-1].arguments += text
            events.append(("arguments", len(self.calls) - 1, text))


def _whole_call(body: str) -> ParsedCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in ARGUMENT_KEYS if k in obj), {})
    text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return ParsedCall(obj["name"], text, complete=True)


def parse_tool_calls(text: str) -> tuple[str, list[ParsedCall]]:
    """Content (text outside the calls) and the calls of a whole text."""
    parser = ToolCallParser()
    parser.feed(text)
    parser.finish()
    return "".join(parser.content), parser.calls
