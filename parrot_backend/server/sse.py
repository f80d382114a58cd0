"""OpenAI-style SSE framing on top of sse-starlette.

OpenAI streams are data-only: `data: {json}\\n\\n` per chunk and `data: [DONE]\\n\\n` at the
end, no `event:` or `id:` lines. We encode frames ourselves (bytes pass through
sse-starlette untouched) so the framing is exact.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, Awaitable, Callable
from typing import Any

from sse_starlette import EventSourceResponse
from sse_starlette.event import ServerSentEvent
from starlette.types import Receive, Scope, Send

DONE_FRAME = b"data: [DONE]\n\n"


def data_frame(payload: dict[str, Any]) -> bytes:
    """One `data:` event. Compact JSON never contains a newline, so one line suffices."""
    text = json.dumps(payload, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return b"data: " + text.encode("utf-8") + b"\n\n"


def _ping() -> ServerSentEvent:
    # A comment line: clients ignore it, proxies see traffic and keep the connection open.
    return ServerSentEvent(comment="ping", sep="\n")


class ClosingEventSourceResponse(EventSourceResponse):
    """An EventSourceResponse that always runs `on_close` once it is done or abandoned.

    The body generator's own `finally` does not run if the stream never started (the
    client left before the first chunk), so cleanup that must happen is hooked here too.
    """

    def __init__(
        self,
        content: AsyncIterable[bytes],
        *,
        on_close: Callable[[], Awaitable[None]],
        ping_s: float,
        send_timeout_s: float | None,
        shutdown_grace_s: float = 0.0,
    ) -> None:
        super().__init__(
            content,
            ping=ping_s,
            sep="\n",
            ping_message_factory=_ping,
            # A frozen client (not reading) would otherwise hold its engine context forever.
            send_timeout=send_timeout_s,
            # On shutdown, let running generations finish (drain) before cancelling them.
            shutdown_grace_period=shutdown_grace_s,
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()
