"""Write-before-acknowledge: a `RunListener` that commits every manager event to the store.

The manager awaits `on_event` before the change it reports becomes visible (to `get`,
run status, event subscribers), so whatever a client can observe is already committed.
Store calls are synchronous SQLAlchemy units of work; they run in worker threads so the
event loop (and with it the engine's scheduling) never waits on the database. Store
writes go to one writer thread on SQLite (its single writer lock would otherwise make
threads sleep in the busy handler).

- `persister.py`: `StorePersister`, the listener: takes each event, buffers it or runs
  its handler in one transaction with what the run had buffered;
- `handlers.py`: what each event type writes (`run_created`, `call_started`, ...);
- `buffer.py`: token events and call ends, buffered and written in batches (the rule of
  what waits for what is stated there);
- `leases.py`: renewing the claims this process holds on its running calls;
- `meta.py`: `RunMeta`, what the persister knows about a run.
"""

from .meta import RunMeta
from .persister import StorePersister

__all__ = ["RunMeta", "StorePersister"]
