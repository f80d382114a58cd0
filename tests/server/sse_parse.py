"""Strict parsing of OpenAI-style SSE bodies for assertions."""

from __future__ import annotations

import json


def parse_sse(raw: str) -> list:
    """Split a body into events; every event must be one `data:` line (comments allowed).
    Returns decoded JSON payloads, with the final "[DONE]" kept as the string."""
    assert raw.endswith("\n\n"), f"stream does not end with a blank line: {raw[-40:]!r}"
    events = []
    for block in raw.split("\n\n")[:-1]:
        lines = [ln for ln in block.split("\n") if not ln.startswith(":")]
        if not lines:
            continue  # a ping comment
        assert len(lines) == 1 and lines[0].startswith("data: "), f"bad event {block!r}"
        data = lines[0][len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    assert events and events[-1] == "[DONE]", "stream must end with data: [DONE]"
    assert events.count("[DONE]") == 1
    return events
