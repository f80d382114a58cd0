"""The :class:`Store`: the repository the manager and the server call."""

from __future__ import annotations

from sqlalchemy.engine import URL

from parrot_backend.store import schema
from parrot_backend.store.calls import CallsMixin
from parrot_backend.store.db import default_url, make_engine, parse_url
from parrot_backend.store.events import EventsMixin
from parrot_backend.store.recovery import RecoveryMixin
from parrot_backend.store.runs import RunsMixin
from parrot_backend.store.tenants import TenantsMixin
from parrot_backend.store.variables import VariablesMixin
from parrot_backend.store.workflows import WorkflowsMixin


class Store(
    TenantsMixin,
    WorkflowsMixin,
    RunsMixin,
    RecoveryMixin,
    VariablesMixin,
    CallsMixin,
    EventsMixin,
):
    """A SQL store of tenants, workflows, runs, variables, calls and events.

    Opening it checks the schema first: with ``upgrade=True`` (the server's default) an
    empty or older schema is migrated to the head revision; with ``upgrade=False`` anything
    but the current schema is refused. A foreign or corrupt database, a schema newer than
    this code, or a bad URL raise a :class:`~parrot_backend.store.errors.StoreError`
    before anything is written. Every method is one unit of work (one transaction).
    Thread-safe; each process opens its own Store.
    """

    def __init__(
        self, url: str | URL | None = None, *, upgrade: bool = True, pool_size: int = 5
    ) -> None:
        parsed = parse_url(url if url is not None else default_url())
        self.url = parsed
        self.schema = schema.upgrade(parsed) if upgrade else schema.check(parsed)
        self._bind(make_engine(parsed, pool_size=pool_size))

    def close(self) -> None:
        """Release the connection pool."""
        self.engine.dispose()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
