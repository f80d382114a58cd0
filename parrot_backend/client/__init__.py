"""The Python SDK: semantic functions, variable handles, sessions and backends.

    from parrot_backend.client import semantic_function, set_backend

See `function.py` for the decorator, `session.py` for how programs are built and
submitted, and `backend.py` for where they run.
"""

from __future__ import annotations

from .backend import Backend, InProcessBackend, run_async, run_sync
from .function import SemanticFunction, semantic_function
from .http import HttpBackend, ServerError
from .session import SemanticVariable, Session, current_session, set_backend

__all__ = [
    "Backend",
    "HttpBackend",
    "InProcessBackend",
    "SemanticFunction",
    "SemanticVariable",
    "ServerError",
    "Session",
    "current_session",
    "run_async",
    "run_sync",
    "semantic_function",
    "set_backend",
]
