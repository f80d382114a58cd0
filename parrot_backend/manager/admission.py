"""Admission: what a new run, or calls added to an open run, may bring.

Checked before anything changes, so a refused request leaves no trace:

- size: a run holds at most `max_calls_per_run` calls, all additions of an open run
  included (a ProgramError, 400);
- limits: every generation config fits the model's vocabulary and context
  (`EngineSet.check_limits`; a ProgramError, 400);
- prompt: every call has text or an input before its first output, the prompt the model
  continues (a ProgramError, 400; it failed the call at run time);
- tenant: a tenant has at most `max_calls_per_tenant` calls ready or running at once,
  counting the calls the request would make ready now (TenantBusy, 429: retry later).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from parrot_backend.program import Call, ProgramError
from parrot_backend.program.template import OutputRef

from .engines import EngineSet
from .ready_queue import ReadyQueue
from .runs import TenantBusy


class Admission:
    """Admission checks against the manager's caps, engines and ready queue."""

    def __init__(
        self,
        max_calls_per_run: int,
        max_calls_per_tenant: int,
        engines: EngineSet,
        queue: ReadyQueue,
    ) -> None:
        self.max_calls_per_run = max_calls_per_run
        self.max_calls_per_tenant = max_calls_per_tenant
        self.engines = engines
        self.queue = queue

    def check_size(self, n_calls: int, what: str) -> None:
        """Raise ProgramError if `what` would hold more calls than a run may."""
        cap = self.max_calls_per_run
        if n_calls > cap:
            raise ProgramError(f"{what} would have {n_calls} calls; a run holds at most {cap}")

    def check_calls(
        self,
        calls: Iterable[Call],
        tenant: str | None,
        values: Mapping[str, str],
        limits: bool = True,
    ) -> None:
        """Raise if `calls` do not fit the model (`limits`) or would make more calls of
        `tenant` ready now (those with every input in `values`) than it may have."""
        calls = list(calls)
        bare = [c for c in calls if c.segments and isinstance(c.segments[0], OutputRef)]
        if bare:
            problems = [
                f"call {c.name!r}: nothing before {{{{output:{c.segments[0].name}}}}}; a call "
                "needs text or an input before its first output (the prompt the model continues)"
                for c in bare
            ]
            raise ProgramError("; ".join(problems[:5]), problems)
        if limits:
            self.engines.check_limits(calls)
        adding = sum(1 for c in calls if c.outputs and all(i in values for i in c.inputs))
        cap = self.max_calls_per_tenant
        now = self.queue.inflight.get(tenant, 0)
        if adding and now + adding > cap:
            raise TenantBusy(
                f"{now} calls of this tenant are ready or running and {adding} more would "
                f"start (at most {cap} at once); retry when some have finished"
            )
