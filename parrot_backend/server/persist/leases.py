"""Renewing the claims this process holds on its runs' calls.

A claim (the store's lease on a call) must outlive the longest call: while the process
lives, every call of its runs is renewed every third of `lease_s`. A process that dies
stops renewing, and its calls can be claimed elsewhere once their leases ran out.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from parrot_backend.store import Store

from .meta import RunMeta

log = logging.getLogger(__name__)


async def renew_leases(
    store: Store,
    worker: str,
    runs: dict[str, RunMeta],
    db: Callable[..., Awaitable[Any]],
    lease_s: float,
) -> None:
    """Renew the leases of `worker`'s calls in `runs` forever (a background task)."""
    while True:
        await asyncio.sleep(lease_s / 3)
        ids = [cid for m in runs.values() for cid in m.call_ids.values()]
        if ids:
            try:
                await db(store.renew_lease, worker, ids, lease_s)
            except Exception:
                log.exception("renewing call leases failed")
