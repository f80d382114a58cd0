"""The context tree: an engine's contexts by id, forked from their parents.

A new context is made from its parent (its tokens, its salt) but enters the tree only
once its first request is known to be valid (`open`, then `register`), so a refused
request leaves nothing behind. A context with live children, or with requests in
progress, cannot be freed (`ContextBusy`): the manager frees children first, and a
silent deferral hid bugs. Freeing releases the blocks no other context holds.
"""

from __future__ import annotations

from collections.abc import Hashable

from parrot_backend.contract.errors import ContextBusy, ContextNotFound, InvalidRequest

from .block_pool import BlockPool
from .context import Context


class ContextTree:
    """The contexts of one engine over its block pool; `max_model_len` bounds each."""

    def __init__(self, pool: BlockPool, max_model_len: int) -> None:
        self.pool = pool
        self.max_model_len = max_model_len
        self.contexts: dict[Hashable, Context] = {}

    def __len__(self) -> int:
        return len(self.contexts)

    def get(self, context_id: Hashable) -> Context:
        """The context, or ContextNotFound."""
        try:
            return self.contexts[context_id]
        except (KeyError, TypeError):
            raise ContextNotFound(
                f"unknown context {context_id!r} (never created or freed)"
            ) from None

    def open(self, context_id: Hashable, parent_id: Hashable | None, salt: str | None) -> Context:
        """The context `context_id`, or a new one forked from `parent_id` (not in the tree
        until `register`: the caller validates the request first)."""
        try:
            hash(context_id)
        except TypeError:
            raise InvalidRequest("context_id must be hashable (an int or a string)") from None
        if context_id is None:
            raise InvalidRequest("context_id must not be None")
        ctx = self.contexts.get(context_id)
        if ctx is not None:
            if parent_id is not None and (ctx.parent is None or ctx.parent.id != parent_id):
                raise InvalidRequest(f"context {context_id!r} exists with a different parent")
            return ctx
        parent = self.get(parent_id) if parent_id is not None else None
        if parent_id is not None and parent_id == context_id:
            raise InvalidRequest("a context cannot be its own parent")
        return Context(context_id, parent, salt, self.pool.block_size)

    def register(self, ctx: Context) -> None:
        """Put a context made by `open` into the tree (a no-op for one already there)."""
        if ctx.id not in self.contexts:
            self.contexts[ctx.id] = ctx
            if ctx.parent is not None:
                ctx.parent.children.add(ctx.id)

    def check_length(self, ctx: Context, adding: int, generating: int) -> None:
        """Raise InvalidRequest if `ctx` cannot grow by `adding` tokens plus `generating`:
        longer than the model allows, or more blocks than the pool has."""
        total = len(ctx.tokens) + adding + generating
        if total > self.max_model_len:
            raise InvalidRequest(
                f"context {ctx.id!r} would hold {total} tokens, more than the model's "
                f"maximum of {self.max_model_len}"
            )
        need = -(-total // self.pool.block_size)
        if need > self.pool.num_blocks:
            raise InvalidRequest(
                f"context {ctx.id!r} needs {need} KV blocks; the pool has {self.pool.num_blocks}"
            )

    def free(self, context_id: Hashable) -> None:
        """Release a context; blocks still held by other contexts stay alive."""
        ctx = self.get(context_id)
        if ctx.children:
            raise ContextBusy(
                f"context {context_id!r} has {len(ctx.children)} live child "
                f"context(s); free them first"
            )
        if ctx.queue:
            raise ContextBusy(
                f"context {context_id!r} has {len(ctx.queue)} request(s) "
                f"in progress; cancel them first"
            )
        for b in ctx.blocks:
            self.pool.decref(b)
        ctx.blocks = []
        ctx.freed = True
        del self.contexts[context_id]
        if ctx.parent is not None:
            ctx.parent.children.discard(context_id)
