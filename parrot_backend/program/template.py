"""Prompt templates with semantic-variable placeholders (the paper's syntax).

Grammar:

- `{{input:NAME}}` reads semantic variable NAME; `{{output:NAME}}` is where the
  call generates NAME. Nothing else is allowed between the braces: no spaces.
- NAME matches `[A-Za-z_][A-Za-z0-9_.-]*` (identifier-like; dots and dashes
  allow names such as `agent.1-reply`).
- Escapes: only a backslash run directly before a `{` is special. `\\{` is a
  literal `{`, so `\\{{` renders `{{` and never opens a placeholder; `\\\\` before
  a `{` is one literal backslash (`\\\\{{input:x}}` is a backslash followed by
  the value of x). Backslashes anywhere else are plain text (`C:\\dir`,
  `\\frac`), as are single braces and a stray `}}`.
- An output may appear once per template, and a name cannot be both an input
  and an output of one template (the call would read what it writes).

Values substituted into a template are data: `render` never parses them, so a
value containing `{{...}}` stays literal text.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .errors import MissingInputError, TemplateError
from .text import MAX_NAME_LENGTH

NAME_PATTERN = r"[A-Za-z_][A-Za-z0-9_.-]*"
_NAME = re.compile(NAME_PATTERN)
_NAME_START = re.compile(r"[A-Za-z_]")
_NAME_BAD_CHAR = re.compile(r"[^A-Za-z0-9_.-]")
# A `{` together with the backslash run right before it: the only place escapes matter.
_BRACE = re.compile(r"\\*\{")
_KINDS = ("input", "output")


@dataclass(slots=True, frozen=True)
class Text:
    """Literal text of a template."""

    text: str


@dataclass(slots=True, frozen=True)
class InputRef:
    """A placeholder reading semantic variable `name`."""

    name: str


@dataclass(slots=True, frozen=True)
class OutputRef:
    """A placeholder where the call generates semantic variable `name`."""

    name: str


Segment = Text | InputRef | OutputRef


def is_valid_name(name: str) -> bool:
    """Whether `name` is a legal semantic-variable name (at most MAX_NAME_LENGTH long)."""
    return len(name) <= MAX_NAME_LENGTH and _NAME.fullmatch(name) is not None


def parse(template: str) -> list[Segment]:
    """Split `template` into segments; adjacent text is merged and empty text dropped.

    Raises TemplateError whose `position` points at the fault.
    """
    segments: list[Segment] = []
    text: list[str] = []
    seen: dict[str, str] = {}  # name -> kind already used in this template
    pos = 0
    while True:
        m = _BRACE.search(template, pos)
        if m is None:
            text.append(template[pos:])
            break
        text.append(template[pos : m.start()])
        slashes = m.end() - 1 - m.start()
        text.append("\\" * (slashes // 2))
        brace = m.end() - 1
        if slashes % 2 or not template.startswith("{{", brace):
            text.append("{")
            pos = m.end()
            continue
        ref, pos = _placeholder(template, brace)
        _check_reuse(ref, seen, brace)
        if chunk := "".join(text):
            segments.append(Text(chunk))
        text.clear()
        segments.append(ref)
    if chunk := "".join(text):
        segments.append(Text(chunk))
    return segments


def _placeholder(template: str, start: int) -> tuple[InputRef | OutputRef, int]:
    """Parse the placeholder whose `{{` is at `start`; return it and the offset after `}}`."""
    close = template.find("}}", start + 2)
    if close < 0:
        raise TemplateError("unclosed placeholder: '{{' without a matching '}}'", start)
    body = template[start + 2 : close]
    colon = body.find(":")
    if colon < 0:
        raise TemplateError(
            f"malformed placeholder {{{{{body}}}}}: expected {{{{input:NAME}}}} or "
            "{{output:NAME}} (write \\{{ for literal braces)",
            start,
        )
    kind, name = body[:colon], body[colon + 1 :]
    if kind not in _KINDS:
        if kind.strip() in _KINDS:
            raise TemplateError("no spaces are allowed inside a placeholder", start + 2)
        raise TemplateError(
            f"unknown placeholder kind {kind!r}: expected 'input' or 'output'", start + 2
        )
    name_at = start + 2 + colon + 1
    if not name:
        raise TemplateError(f"empty variable name in {{{{{kind}:}}}}", name_at)
    if not _NAME_START.match(name):
        raise TemplateError(_bad_name(name), name_at)
    bad = _NAME_BAD_CHAR.search(name)
    if bad is not None:
        raise TemplateError(_bad_name(name), name_at + bad.start())
    if len(name) > MAX_NAME_LENGTH:
        raise TemplateError(
            f"variable name of {len(name)} characters: at most {MAX_NAME_LENGTH}", name_at
        )
    ref = InputRef(name) if kind == "input" else OutputRef(name)
    return ref, close + 2


def _bad_name(name: str) -> str:
    return f"invalid variable name {name!r}: names match {NAME_PATTERN}"


def _check_reuse(ref: InputRef | OutputRef, seen: dict[str, str], at: int) -> None:
    kind = "output" if isinstance(ref, OutputRef) else "input"
    before = seen.get(ref.name)
    if before == "output" and kind == "output":
        raise TemplateError(f"output {ref.name!r} appears twice in one template", at)
    if before is not None and before != kind:
        raise TemplateError(
            f"variable {ref.name!r} is both an input and an output of one template", at
        )
    seen[ref.name] = kind


def unparse(segments: Iterable[Segment]) -> str:
    """The template source of `segments`: `parse(unparse(s)) == s` for normalized `s`."""
    parts: list[str] = []
    merged = _merge_text(segments)
    for i, seg in enumerate(merged):
        if isinstance(seg, Text):
            parts.append(_escape(seg.text, before_placeholder=i + 1 < len(merged)))
        elif isinstance(seg, InputRef):
            parts.append(f"{{{{input:{seg.name}}}}}")
        else:
            parts.append(f"{{{{output:{seg.name}}}}}")
    return "".join(parts)


def _escape(text: str, before_placeholder: bool) -> str:
    """Escape `text` so it parses back to itself; only braces that would open a placeholder
    are escaped, so ordinary prose and code stay readable."""
    # a placeholder right after the text begins with `{`
    follow = text + ("{" if before_placeholder else "")

    def fix(m: re.Match[str]) -> str:
        slashes = len(m.group()) - 1
        opens = follow.startswith("{", m.end())
        return "\\" * (2 * slashes) + ("\\{" if opens else "{")

    escaped = _BRACE.sub(fix, text)
    if before_placeholder:
        # trailing backslashes would otherwise escape the placeholder's first brace
        stripped = escaped.rstrip("\\")
        escaped = stripped + "\\" * (2 * (len(escaped) - len(stripped)))
    return escaped


def _merge_text(segments: Iterable[Segment]) -> list[Segment]:
    out: list[Segment] = []
    for seg in segments:
        if isinstance(seg, Text):
            if not seg.text:
                continue
            if out and isinstance(out[-1], Text):
                out[-1] = Text(out[-1].text + seg.text)
                continue
        out.append(seg)
    return out


def render(segments: Iterable[Segment], values: Mapping[str, str]) -> str:
    """Substitute `values` for every placeholder; values are inserted verbatim, never parsed.

    Raises MissingInputError naming the variables without a value.
    """
    parts: list[str] = []
    missing: list[str] = []
    for seg in segments:
        if isinstance(seg, Text):
            parts.append(seg.text)
        elif seg.name in values:
            parts.append(values[seg.name])
        elif seg.name not in missing:
            missing.append(seg.name)
    if missing:
        raise MissingInputError(f"no value for variables: {', '.join(map(repr, missing))}")
    return "".join(parts)


def input_names(segments: Iterable[Segment]) -> list[str]:
    """Names read by the template, in first-use order, without repeats."""
    return list(dict.fromkeys(s.name for s in segments if isinstance(s, InputRef)))


def output_names(segments: Iterable[Segment]) -> list[str]:
    """Names generated by the template, in order."""
    return [s.name for s in segments if isinstance(s, OutputRef)]
