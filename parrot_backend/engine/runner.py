"""Runs one scheduled step on the model: builds the flat batch, forwards, samples.

A step is prepared on the engine's event loop (`prepare`: a `Batch` of plain copies of
the token ids, positions, slots and block tables it needs) and computed on the compute
thread (`execute`). The compute thread never reads a `Context`: a task that frees a
context, cancels its request or fills more tokens into it while the step runs changes
nothing the step uses. Freed blocks go back to the pool at once, but blocks are only
handed out again by the scheduler, which plans the next step after this one ends.

A step may run layer by layer with a check between layers (`execute(batch,
should_pause)`): when the check says so (a more urgent request arrived, `step_loop.py`),
the step stops after a layer and returns a `Paused` (the hidden states between layers
and the step's attention metadata); `resume` goes on from that layer. Each layer writes
its own KV cache, so the layers before the pause keep theirs, and a step that runs in
between writes only other blocks (the step loop pins the paused step's blocks: none is
handed out again before it ends). The result is the one an unpaused step computes: the
same layers on the same inputs, in the same order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .attention import AttentionBackend, AttentionMetadata, find_prefix_groups
from .context import PromptScores
from .sampler import Sampler
from .scheduler import Work
from .speculate import accept

# Prompt log probabilities: the lm-head and log-softmax over a chunk's positions, this many
# positions at a time (49,152 float32 logits each: 256 positions are 48 MiB)
PROMPT_LOGITS_ROWS = 256


@dataclass(slots=True)
class Batch:
    """One step's inputs, copied from the contexts before the step runs."""

    ids: list[int]
    positions: list[int]
    slots: list[int]
    query_start: list[int]
    seq_lens: list[int]
    tables: list[list[int]]
    samplers: list[Sampler | None]  # per sequence: who samples its next token, if any
    keep: list[bool]  # per sequence: a fill ending its context returns its last hidden state
    rows: list[int]  # per sequence: its index in the step's work
    # sample-only rows (a generation's first token from a fill's kept state, nothing to
    # compute): (index in the step's work, hidden state, sampler)
    kept: list[tuple[int, torch.Tensor, Sampler]]
    size: int  # rows of work in the step
    # KV written twice: the flat batch's row `copy_rows[i]` also at `copy_slots[i]` (the
    # parent's partial block, in a fork that joined the parent's step)
    copy_rows: list[int]
    copy_slots: list[int]
    # per sequence: draft tokens computed after its context's last token (their greedy
    # checks make the row's result a list of tokens, `speculate.accept`), or None
    drafts: list[list[int] | None]
    # per sequence: the log probabilities its chunk's positions fill in (a scoring fill,
    # `fill(..., prompt_logprobs=k)`), or None (the rows that did not ask: no extra work)
    scores: list[PromptScores | None]


# a token, the tokens of a row with drafts, the error of this row, a fill's kept last
# hidden state, or nothing
StepResult = int | list[int] | BaseException | torch.Tensor | None


@dataclass(slots=True)
class Paused:
    """A step stopped between two layers (`ModelRunner.execute` with `should_pause`)."""

    batch: Batch
    x: torch.Tensor  # the next layer's input
    rope: tuple
    meta: AttentionMetadata
    layer: int  # the next layer to run


class ModelRunner:
    """Owns the model, the paged KV cache tensors and the attention backend."""

    def __init__(
        self,
        model,
        config,
        *,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        backend: AttentionBackend,
    ) -> None:
        self.model = model
        self.config = config
        self.block_size = block_size
        self.device = device
        self.backend = backend
        self.pending_copies: list[tuple[int, int]] = []
        n_kv = config.num_key_value_heads or config.num_attention_heads
        head_dim = model.model.layers[0].self_attn.head_dim
        shape = (num_blocks, block_size, n_kv, head_dim)
        # zeros, not empty: masked-out slots must never hold NaN (0 * NaN poisons attention)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device),
            )
            for _ in range(config.num_hidden_layers)
        ]

    @staticmethod
    def bytes_per_block(config, block_size: int, dtype: torch.dtype) -> int:
        n_kv = config.num_key_value_heads or config.num_attention_heads
        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        elem = torch.tensor([], dtype=dtype).element_size()
        return 2 * config.num_hidden_layers * block_size * n_kv * head_dim * elem

    def copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write of one block, done on the compute thread before the next forward."""
        self.pending_copies.append((src, dst))

    def _flush_copies(self) -> None:
        # taken before copying: a step that fails half-way must not replay the list (a
        # freed source may be a later destination, so a replay would copy new contents)
        copies, self.pending_copies = self.pending_copies, []
        for src, dst in copies:  # in order: a freed source may be a later dst
            for k, v in self.kv_caches:
                k[dst].copy_(k[src])
                v[dst].copy_(v[src])

    def prepare(self, work: list[Work]) -> Batch:
        """Copy what the step needs out of the contexts (on the engine loop, torch-free)."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        samplers: list[Sampler | None] = []
        keep: list[bool] = []
        rows: list[int] = []
        kept: list[tuple[int, torch.Tensor, Sampler]] = []
        copy_rows: list[int] = []
        copy_slots: list[int] = []
        drafts: list[list[int] | None] = []
        scores: list[PromptScores | None] = []
        for j, w in enumerate(work):
            ctx = w.req.ctx
            end = w.start + w.n
            if w.n == 0:  # the scheduler checked the kept state: it is for these tokens
                kept.append((j, ctx.last_hidden[1], w.req.sampler))
                continue
            rows.append(j)
            for p, slot in w.copies or ():
                copy_rows.append(len(ids) + p - w.start)
                copy_slots.append(slot)
            keep.append(w.req.kind == "fill" and end == len(ctx.tokens))
            ids.extend(ctx.tokens[w.start : end])
            draft = w.draft if w.samples else None
            if draft:  # checked after the context's last token, in the same row
                ids.extend(draft)
                end += len(draft)
            positions.extend(range(w.start, end))
            blocks = list(ctx.blocks)
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(w.start, end))
            starts.append(starts[-1] + end - w.start)
            seq_lens.append(end)
            tables.append(blocks)
            samplers.append(w.req.sampler if w.samples else None)
            drafts.append(draft or None)
            scores.append(w.req.scores)
        return Batch(
            ids,
            positions,
            slots,
            starts,
            seq_lens,
            tables,
            samplers,
            keep,
            rows,
            kept,
            len(work),
            copy_rows,
            copy_slots,
            drafts,
            scores,
        )

    def _tensors(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        self._flush_copies()
        width = max(len(t) for t in batch.tables)
        # padded with block 0: slots past a sequence's length are masked by seq_lens
        tables = torch.tensor([t + [0] * (width - len(t)) for t in batch.tables], dtype=torch.int32)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(batch.slots, dtype=torch.long, device=dev),
            query_start=batch.query_start,
            seq_lens=batch.seq_lens,
            block_tables=tables.to(dev),
            block_size=self.block_size,
        )
        if batch.copy_rows:
            meta.copy_rows = torch.tensor(batch.copy_rows, dtype=torch.long, device=dev)
            meta.copy_slots = torch.tensor(batch.copy_slots, dtype=torch.long, device=dev)
        qlens = [
            batch.query_start[i + 1] - batch.query_start[i] for i in range(len(batch.seq_lens))
        ]
        if self.backend.groups_prefixes and 1 in qlens:
            meta.prefix_groups = find_prefix_groups(meta, self.backend.share_prefix)
        if self.backend.groups_prefill and sum(n > 1 for n in qlens) > 1:
            # forks' prefill chunks in one step (a program's users, say) may share a prefix
            meta.prefill_groups = find_prefix_groups(
                meta, self.backend.share_prefill_prefix, prefill=True
            )
        return (
            torch.tensor(batch.ids, dtype=torch.long, device=dev),
            torch.tensor(batch.positions, dtype=torch.long, device=dev),
            meta,
        )

    @torch.inference_mode()
    def execute(
        self, batch: Batch, should_pause: Callable[[], bool] | None = None
    ) -> list[StepResult] | Paused:
        """Compute KV for every sequence; sample a token for those that reach their end.

        A sampler that fails fails its own row only (its error is that row's result); a
        failing forward pass raises (the engine then retries the rows one by one). With
        `should_pause`, the step runs layer by layer and stops after a layer where it
        returns true (not after the last): the result is then a `Paused` for `resume`."""
        hidden = None
        if batch.ids:
            ids, positions, meta = self._tensors(batch)
            if should_pause is None or not hasattr(getattr(self.model, "model", None), "embed"):
                hidden = self.model(ids, positions, self.kv_caches, meta, self.backend)
            else:
                x, rope = self.model.model.embed(ids, positions)
                paused = Paused(batch, x, rope, meta, 0)
                hidden = self._layers(paused, should_pause)
                if hidden is None:
                    return paused
        return self._results(batch, hidden)

    @torch.inference_mode()
    def resume(
        self, paused: Paused, should_pause: Callable[[], bool] | None = None
    ) -> list[StepResult] | Paused:
        """Go on with a paused step from its next layer (it may pause again)."""
        hidden = self._layers(paused, should_pause)
        return paused if hidden is None else self._results(paused.batch, hidden)

    def _layers(
        self, paused: Paused, should_pause: Callable[[], bool] | None
    ) -> torch.Tensor | None:
        """Run a step's layers from `paused.layer` on; the final hidden states, or None
        when it paused (then `paused` holds where it stopped)."""
        model = self.model.model
        layers = model.layers
        x = paused.x
        for i in range(paused.layer, len(layers)):
            x = layers[i](x, paused.rope, self.kv_caches[i], paused.meta, self.backend)
            if i + 1 < len(layers) and should_pause is not None and should_pause():
                paused.x, paused.layer = x, i + 1
                return None
        paused.x = None  # the step's memory goes with its results
        return model.norm(x)

    def _results(self, batch: Batch, hidden: torch.Tensor | None) -> list[StepResult]:
        """Each row's result from the step's final hidden states (None: no row computed)."""
        out: list[StepResult] = [None] * batch.size
        last: list[torch.Tensor] = []  # final hidden states to sample from, in this order
        who: list[tuple[int, Sampler]] = []
        checks: list[tuple[int, torch.Tensor, list[int], Sampler]] = []  # rows with drafts
        failed: dict[int, BaseException] = {}  # rows whose scoring failed
        if hidden is not None:
            for i, j in enumerate(batch.rows):
                end = batch.query_start[i + 1]
                if batch.scores[i] is not None:
                    start = batch.query_start[i]
                    try:
                        self._score_prompt(
                            batch.scores[i], hidden[start:end], batch.positions[start]
                        )
                    except Exception as exc:  # this request's scoring, not the step
                        failed[j] = exc
                draft = batch.drafts[i]
                if draft is not None:  # the last real token's state and each draft token's
                    h = hidden[end - len(draft) - 1 : end]
                    checks.append((j, h, draft, batch.samplers[i]))
                    continue
                h = hidden[end - 1]
                if batch.samplers[i] is not None:
                    last.append(h)
                    who.append((j, batch.samplers[i]))
                elif batch.keep[i]:
                    out[j] = h.clone()  # a view would keep the whole step's hidden alive
        for j, h, sampler in batch.kept:
            last.append(h)
            who.append((j, sampler))
        if checks:
            self._check_drafts(checks, out)
        if last:
            logits = self.model.logits(torch.stack(last))
            for k, (j, sampler) in enumerate(who):
                try:
                    out[j] = sampler(logits[k])
                except Exception as exc:  # this request's sampling, not the step
                    out[j] = exc
        for j, exc in failed.items():
            out[j] = exc
        return out

    def _score_prompt(self, scores: PromptScores, hidden: torch.Tensor, start: int) -> None:
        """Fill in the entries that a chunk's positions [start, start + len(hidden))
        predict: position p's log-softmax of the raw logits gives token p + 1's logprob and
        the top `k`, for the fill's tokens after its first (positions before the fill, a
        chunk that starts earlier, and the fill's last position, which predicts the next
        request's token, give none). In slices of `PROMPT_LOGITS_ROWS` positions."""
        tokens, k = scores.tokens, scores.k
        lo = max(start, scores.start)  # the first position that predicts a fill's token
        hi = min(start + len(hidden), scores.start + len(tokens) - 1)  # past the last
        for a in range(lo, hi, PROMPT_LOGITS_ROWS):
            b = min(a + PROMPT_LOGITS_ROWS, hi)
            h = hidden[a - start : b - start]
            lp = torch.log_softmax(self.model.logits(h).float(), dim=-1)
            first = a + 1 - scores.start  # the entry of position a's next token
            targets = torch.tensor(tokens[first : first + b - a], device=lp.device)
            chosen = lp.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
            if k:
                values, ids = torch.topk(lp, min(k, lp.shape[-1]), dim=-1)
                tops = [
                    list(zip(i, v, strict=True))
                    for i, v in zip(ids.tolist(), values.tolist(), strict=True)
                ]
            else:
                tops = [[] for _ in chosen]
            for r, (c, top) in enumerate(zip(chosen, tops, strict=True)):
                scores.entries[first + r] = (c, top)

    def _check_drafts(
        self, checks: list[tuple[int, torch.Tensor, list[int], Sampler]], out: list[StepResult]
    ) -> None:
        """Each row with drafts: its tokens (`speculate.accept`), picked position by position
        by its sampler; a plain greedy row's picks are the argmax, taken for all at once."""
        logits = self.model.logits(torch.cat([h for _, h, _, _ in checks]))
        argmax: list[int] | None = None
        at = 0
        for j, h, draft, sampler in checks:
            rows = logits[at : at + len(h)]
            if sampler.plain_greedy:
                if argmax is None:
                    argmax = logits.argmax(dim=-1).tolist()
                out[j] = accept(draft, argmax[at : at + len(h)].__getitem__)
            else:
                try:
                    out[j] = accept(draft, lambda i, rows=rows, s=sampler: s(rows[i]))
                except Exception as exc:  # this request's sampling, not the step
                    out[j] = exc
                sampler.banned = None  # the masks of positions after a rejected draft
            at += len(h)

    @torch.inference_mode()
    def logits_for(self, work: list[Work]) -> torch.Tensor:
        """All-position logits of one step (tests compare them with transformers)."""
        ids, positions, meta = self._tensors(self.prepare(work))
        return self.model.logits(self.model(ids, positions, self.kv_caches, meta, self.backend))
