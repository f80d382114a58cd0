"""Errors an engine reports to one request. None of them stops the engine: it keeps serving
the others."""

from __future__ import annotations


class EngineError(Exception):
    """Base class for errors reported to one request; the engine keeps serving others."""


class InvalidRequest(EngineError, ValueError):
    """The request itself is malformed: bad sampling values, empty or oversized prompt."""


class ContextNotFound(EngineError, KeyError):
    """A context id that was never created or was already freed."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "context not found"


class ContextBusy(EngineError):
    """A context cannot be used now: it is generating, or it still has live children."""


class OutOfMemory(EngineError):
    """The KV pool cannot hold this request even with everything else preempted."""


class UnsupportedModel(EngineError, ValueError):
    """A checkpoint whose architecture this engine does not implement."""


class RequestCancelled(EngineError):
    """The request was cancelled before it finished."""


class EngineUnavailable(EngineError):
    """The engine cannot be reached (a remote engine died or its connection broke): the
    manager takes it out of service and dispatches its calls elsewhere."""


class EngineDead(EngineUnavailable):
    """The in-process engine's loop died (a device failure or a bug): nothing it was
    running is the request's fault, so the manager keeps those calls for another engine
    or for the next start of the server instead of failing them."""


class StepFailed(EngineError):
    """Computing this request failed while the engine went on serving others: its step
    failed again with this request alone in it (see the engine's step loop)."""


# The engine API's status for each error (the class name travels as the error `type`);
# `wire.py` maps both ways with it.
HTTP_STATUS: dict[type[EngineError], int] = {
    InvalidRequest: 400,
    ContextNotFound: 404,
    ContextBusy: 409,
    OutOfMemory: 507,
    RequestCancelled: 503,
    StepFailed: 500,
}
