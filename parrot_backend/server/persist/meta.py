"""`RunMeta`: what the persister knows about a run beyond the event payloads."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from parrot_backend.store import CallRecord


@dataclass(slots=True)
class RunMeta:
    """What the persister must know about a run beyond the event payloads."""

    tenant_id: int
    workflow_id: int | None = None
    replay_of: str | None = None
    resumed: bool = False
    program: dict[str, Any] = field(default_factory=dict)  # merged program JSON
    call_ids: dict[str, int] = field(default_factory=dict)  # call name -> store id
    call_idx: dict[str, int] = field(default_factory=dict)  # call name -> index in run
    started: bool = False  # the store's run status is "running"
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # buffered events, in the manager's order: tokens and `call_finished` events
    buffered: list[tuple[str, Any]] = field(default_factory=list)
    finishes: list[dict[str, Any]] = field(default_factory=list)  # buffered call ends
    pending: list[dict[str, Any]] = field(default_factory=list)  # ends taken by a write
    committed: bool = False  # the current write's transaction committed
    first_token: dict[str, datetime] = field(default_factory=dict)  # recorded at the end

    def set_calls(self, calls: tuple[CallRecord, ...]) -> None:
        """Take the store ids and indices of the run's calls."""
        self.call_ids = {c.name: c.id for c in calls if c.name is not None}
        self.call_idx = {c.name: c.idx for c in calls if c.name is not None}
