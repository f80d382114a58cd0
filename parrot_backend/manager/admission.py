"""Admission: what a new run, or calls added to an open run, may bring.

Checked before anything changes, so a refused request leaves no trace:

- size: a run holds at most `max_calls_per_run` calls, all additions of an open run
  included (a ProgramError, 400);
- limits: every generation config fits the model's vocabulary and context
  (`EngineSet.check_limits`; a ProgramError, 400);
- prompt: every call has text or an input before its first output, the prompt the model
  continues (a ProgramError, 400; it failed the call at run time);
- context: a call whose text is all known (its template and the values of its inputs)
  fits the model's context: its prompt, the text between its outputs and a token for
  each output (`check_context`; a ProgramError, 400; it failed the call when it ran).
  Only a text longer in UTF-8 bytes than the context is tokenized here (a token is at
  least a byte, give or take a tokenizer's few added ones), and the tokens are the ones
  the dispatcher renders next (the prompt tokenizer caches them);
- tenant: a tenant has at most `max_calls_per_tenant` calls ready or running at once,
  counting the calls the request would make ready now (TenantBusy, 429: retry later).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from parrot_backend.program import Call, ProgramError, Text
from parrot_backend.program.template import OutputRef

from .engines import EngineSet
from .ready_queue import ReadyQueue
from .render import PromptTokenizer, plan_call
from .runs import TenantBusy


class Admission:
    """Admission checks against the manager's caps, engines and ready queue."""

    def __init__(
        self,
        max_calls_per_run: int,
        max_calls_per_tenant: int,
        engines: EngineSet,
        queue: ReadyQueue,
        tokens: PromptTokenizer | None = None,
    ) -> None:
        self.max_calls_per_run = max_calls_per_run
        self.max_calls_per_tenant = max_calls_per_tenant
        self.engines = engines
        self.queue = queue
        self.tokens = tokens

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

    def check_context(self, calls: Iterable[Call], values: Mapping[str, str]) -> None:
        """Raise ProgramError naming the calls whose text, all known from `values`, cannot
        fit the model's context (calls with an input not in `values` are not checked)."""
        context = self.engines.limits[1]
        if context is None or self.tokens is None:
            return
        problems = []
        for call in calls:
            if not call.outputs or any(name not in values for name in call.inputs):
                continue
            size = len(call.outputs) + _SLACK
            for seg in call.segments:
                if isinstance(seg, Text):
                    size += len(seg.text.encode("utf-8", "surrogatepass"))
                elif not isinstance(seg, OutputRef):
                    size += len(values[seg.name].encode("utf-8", "surrogatepass"))
            if size <= context:
                continue  # fits whatever the tokenizer makes of it
            try:
                plan = plan_call(call, values, self.tokens)
            except Exception:  # noqa: BLE001 - the dispatcher fails the call with it
                continue
            between = sum(len(step.then) for step in plan.steps)
            need = len(plan.prompt) + between + len(plan.steps)
            if need > context:
                first = call.outputs[0]
                problems.append(
                    f"call {call.name!r} needs at least {need} tokens of context (its "
                    f"prompt before {{{{output:{first}}}}} is {len(plan.prompt)} tokens, the "
                    f"text between its outputs {between}, and each of its "
                    f"{len(plan.steps)} outputs at least one); the model's context holds "
                    f"{context}: shorten the template or the input values"
                )
        if problems:
            raise ProgramError("; ".join(problems[:5]), problems)


# tokens a tokenizer may add beyond one per UTF-8 byte (BOS, a SentencePiece word marker)
_SLACK = 8
