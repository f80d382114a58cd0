"""Exceptions raised by ChatParrot and ParrotLLM.

Every failure of a request ends as one of these, with the server's own message where it
sent one: callers catch `ParrotError` (or a subclass) instead of httpx's or json's
exceptions, and a malformed body is a `ParrotResponseError`, never a `KeyError`.
"""

from __future__ import annotations


class ParrotError(Exception):
    """Base class of every error this package raises."""


class ParrotAPIError(ParrotError):
    """The server answered with an error: an HTTP status >= 400, or an error in a stream.

    `status_code` is None for an error reported inside a stream (the status was 200 when
    the stream began). `type`, `param` and `code` are the fields of the server's
    OpenAI-shaped error body, when it sent one.
    """

    def __init__(
        self,
        message: str,
        *,
        status_code: int | None = None,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        self.message = message
        self.status_code = status_code
        self.type = type
        self.param = param
        self.code = code
        parts = [f"HTTP {status_code}" if status_code is not None else "error in stream"]
        if type:
            parts.append(type)
        text = f"{' '.join(parts)}: {message}"
        if param:
            text += f" (param: {param})"
        super().__init__(text)


class ParrotAuthenticationError(ParrotAPIError):
    """401/403: the API key is missing, unknown or not allowed here."""


class ParrotBadRequestError(ParrotAPIError):
    """Another 4xx: the request itself is wrong (a bad parameter, an unknown model, a
    prompt longer than the context); sending it again will not help."""


class ParrotRateLimitError(ParrotAPIError):
    """429 after every retry: the server is at its bound of requests in flight."""


class ParrotServerError(ParrotAPIError):
    """5xx (after the retries for 502/503/504), or a failure the server reported mid-stream."""


class ParrotTimeoutError(ParrotError):
    """The server did not answer within `timeout` seconds."""


class ParrotConnectionError(ParrotError):
    """The server could not be reached (after the retries)."""


class ParrotResponseError(ParrotError):
    """The server's answer is not what the OpenAI-compatible API promises (a missing field,
    bad JSON, a stream that ends without `[DONE]`)."""
