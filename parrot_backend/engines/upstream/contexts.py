"""The context tree an upstream adapter keeps itself: token lists, forks, frees.

An OpenAI-compatible server has no contexts: every request carries its whole prompt. So
the adapter holds what the engine contract calls a context as the list of its tokens.
A fork copies the parent's tokens when the child is created (as the in-process engine
forks once the parent's queued work is done); a fill appends; a generation appends the
tokens it generated. Freeing follows the in-process engine's rules: a parent with live
children or a context that is generating is refused (`ContextBusy`), an unknown id is
`ContextNotFound`. Nothing here does I/O.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from dataclasses import dataclass, field

from parrot_backend.contract.errors import ContextBusy, ContextNotFound, InvalidRequest


@dataclass(slots=True, eq=False)
class Context:
    """One context: its whole prompt so far, and what the adapter needs to know about it.

    `warm`: the warm-up request sent for it as a shared prefix (set when its first child
    is created); its other children wait for the same future.
    """

    id: Hashable
    parent: Context | None
    tokens: list[int]
    salt: str | None
    children: set[Hashable] = field(default_factory=set)
    generating: bool = False
    warm: asyncio.Future[None] | None = None
    warm_len: int = 0  # how many of its tokens `warm` covers


class ContextTree:
    """All contexts of one adapter, by id."""

    def __init__(self) -> None:
        self.contexts: dict[Hashable, Context] = {}

    def __len__(self) -> int:
        return len(self.contexts)

    def get(self, context_id: Hashable) -> Context:
        try:
            return self.contexts[context_id]
        except (KeyError, TypeError):
            raise ContextNotFound(f"unknown context {context_id!r}") from None

    def resolve(
        self, context_id: Hashable, parent_id: Hashable | None, salt: str | None
    ) -> tuple[Context, bool]:
        """The context a request addresses, and whether it is new (not registered yet:
        `add` it once the request is known to be valid). A new context copies its
        parent's tokens and inherits its salt."""
        if context_id is None:
            raise InvalidRequest("context_id must not be None")
        try:
            found = self.contexts.get(context_id)
        except TypeError:
            raise InvalidRequest("context_id must be hashable (an int or a string)") from None
        if found is not None:
            if parent_id is not None and (found.parent is None or found.parent.id != parent_id):
                raise InvalidRequest(f"context {context_id!r} exists with a different parent")
            return found, False
        if parent_id is None:
            return Context(context_id, None, [], salt), True
        if parent_id == context_id:
            raise InvalidRequest("a context cannot be its own parent")
        parent = self.get(parent_id)
        return Context(context_id, parent, list(parent.tokens), parent.salt), True

    def add(self, ctx: Context) -> None:
        """Register a context `resolve` made."""
        if ctx.id not in self.contexts:
            self.contexts[ctx.id] = ctx
            if ctx.parent is not None:
                ctx.parent.children.add(ctx.id)

    def free(self, context_id: Hashable) -> Context:
        """Forget a context (the in-process engine's rules: children and generations
        first)."""
        ctx = self.get(context_id)
        if ctx.children:
            raise ContextBusy(
                f"context {context_id!r} has {len(ctx.children)} live child context(s); "
                f"free them first"
            )
        if ctx.generating:
            raise ContextBusy(f"context {context_id!r} is generating; cancel it first")
        del self.contexts[context_id]
        if ctx.parent is not None:
            ctx.parent.children.discard(context_id)
        return ctx

    def idle_leaves_first(self) -> list[Hashable]:
        """Ids of the contexts not generating, children before their parents (what a
        reset frees)."""
        order: list[Hashable] = []
        seen: set[Hashable] = set()

        def visit(ctx: Context) -> None:
            if ctx.id in seen:
                return
            seen.add(ctx.id)
            for child in list(ctx.children):
                if child in self.contexts:
                    visit(self.contexts[child])
            order.append(ctx.id)

        for ctx in list(self.contexts.values()):
            visit(ctx)
        return [cid for cid in order if not self.contexts[cid].generating]
