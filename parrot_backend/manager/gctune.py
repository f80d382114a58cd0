"""Garbage-collector settings for a long-running server process.

The manager makes many small, short-lived objects per call (plans, events, payload dicts,
tasks, coroutines). With Python's default thresholds (700, 10, 10) the collector runs a
young collection every 700 net allocations and a full one every 70,000, and a full
collection walks every object alive: everything imported at start-up, the engines, and
every run held in memory. In `benchmarks/manager_bench.py` that was 35-40% of the wall
time of the full pipeline.

`configure_gc()` is meant to be called once by the server process after start-up (after
imports, engine and app construction, before serving):

- `gc.freeze()` moves every object alive then to the permanent generation: collections
  no longer walk them (they are never freed, which is what start-up objects are for);
- the generation-0 threshold is raised to `GEN0_THRESHOLD` (generations 1 and 2 keep
  their thresholds), so young collections run about 14x less often. Each one walks more
  objects, but most of them are garbage freed by reference counting anyway; what is left
  is the cycles and the live young objects.

`GEN0_THRESHOLD = 10_000` was chosen on `manager_bench.py`: nearly all the throughput of
higher thresholds with the shortest pauses (figures: benchmarks/README.md, "Garbage
collector threshold").

Library code (the Manager and everything else in this package) never calls this: it is a
process-wide setting that belongs to whoever owns the process.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

GEN0_THRESHOLD = 10_000


@dataclass(slots=True, frozen=True)
class GCSettings:
    """The collector's settings as `configure_gc` found them (see `restore_gc`)."""

    thresholds: tuple[int, int, int]
    enabled: bool
    frozen: int  # objects already in the permanent generation


def configure_gc(gen0_threshold: int = GEN0_THRESHOLD) -> GCSettings:
    """Tune the collector for a long-running server (module doc); returns what it was.

    Collects first, so that start-up garbage is freed rather than frozen; then freezes
    what is alive and sets the generation-0 threshold. Enables the collector if it was
    disabled. Call it once, after start-up.
    """
    if gen0_threshold < 1:
        raise ValueError(f"gen0_threshold must be >= 1, got {gen0_threshold}")
    t0, t1, t2 = gc.get_threshold()
    previous = GCSettings((t0, t1, t2), gc.isenabled(), gc.get_freeze_count())
    gc.collect()
    gc.freeze()
    gc.set_threshold(gen0_threshold, t1, t2)
    gc.enable()
    return previous


def restore_gc(previous: GCSettings) -> None:
    """Undo `configure_gc` (tests, benchmarks): thresholds and enabled state come back,
    and frozen objects return to the oldest generation (`gc.unfreeze()`; that includes
    any frozen before, which the collector will walk again)."""
    gc.unfreeze()
    gc.set_threshold(*previous.thresholds)
    if previous.enabled:
        gc.enable()
    else:
        gc.disable()
