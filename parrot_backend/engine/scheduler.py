"""Iteration-level scheduling over the context tree (continuous batching).

Each step takes every running decode (one token each), then prefill chunks, under a
token budget (chunked prefill). While a more urgent request (a lower `priority`) runs,
decoding or prefilling, the less urgent ones share `background_tokens` per step plus
`background_share` of the urgent work's tokens in that step: their decode rows count one
token each, their prefill its chunk; and every `background_every`-th such step (0: never),
and whenever they have gone `background_wait` seconds without it (0: no limit), they get
an eighth of the step budget. A step's time grows with its tokens, so without the cap a
latency call's every token waits for a full batch of throughput decodes and a chunk of
throughput prefill. On a GPU extra rows are nearly free up to hundreds of tokens: a share
each step suits it. On a CPU extra rows cost more (SmolLM2-135M, 2 cores, oneDNN's
linear: a decode step of 1 row ~36 ms, 5 rows ~50 ms, 12 rows ~80 ms), so there nothing
rides along and the background gets its eighth only after `background_wait` (2 s): a
latency chain under a throughput batch takes ~1.1x its idle time (defaults by device:
`EngineConfig`, `config.pick_background`, `pick_share`).
When a request ends, for `linger` seconds after (`EngineConfig.urgent_linger`) work less
urgent than it gets only that turn's eighth of the budget per step: between the calls of
a latency chain (its value recorded, the next prompt rendered and submitted) the engine
would otherwise plan a full step of throughput prefill (~0.6 s on a CPU), which the
chain's next call waits for. For the first `hold` seconds of the linger
(`EngineConfig.urgent_hold`) it gets nothing: the plan is empty and `wake_at` tells the
loop when to plan again if no request comes first, so the chain's next call, ~10 ms on
its way, starts in an idle engine rather than after a background step.
A step of less urgent work may pause between layers for more urgent work (`step_loop`):
its requests (`paused`) stay running but no plan includes or preempts them; a plan that
finds nothing more urgent to run (past a hold) sets `resume_paused` instead, and the loop
goes on with the paused step.
Waiting requests are admitted by priority, then arrival. A request asks the token-level
prefix cache when it first gets room in a step (again after a preemption), so requests
admitted together find the blocks that earlier ones computed while they waited; one whose
next blocks (`DEDUPE_MIN_TOKENS` or more) another request computes in the same step starts
a step later and takes them from the cache.
A request joins the running set when it heads its context's queue and, for a forked
context, when its parent has no work queued (so the child inherits the parent's computed
blocks), or when the parent's one queued request is a fill that this step completes: then
the fork **joins the parent's step** (`joined`): it takes the parent's blocks below its
fork point, which this step computes (each layer writes every row's KV before any row
attends), and computes its own tokens from there. Its copy of the parent's partial last
block (copy-on-write) gets the parent's KV of that block written twice by the step
(`Work.copies`), so no token is computed twice (at first a fork computed those tokens
again, up to a block less one each). A program's call whose prompt is a new system
prompt plus a question (the prefix filled as a context of its own, the question on a
fork) took two steps, the second ~60 ms for ~15 tokens on a CPU; now one. If the
parent's work fails in that step, its joined forks fail too (`step_loop`). When blocks
run out the newest running request is preempted: its unshared blocks are released and
later recomputed.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from parrot_backend.contract.errors import OutOfMemory

from .block_pool import BlockPool
from .context import Context, PromptScores, Request


@dataclass(slots=True)
class Work:
    """One sequence's share of a step: compute tokens [start, start + n) of its context."""

    req: Request
    start: int
    n: int
    # (position, slot): also write this chunk's KV of that position at that slot, in a
    # block of a fork that joined this step (the module doc)
    copies: list[tuple[int, int]] | None = None
    # draft tokens computed after the context's last token (a generation's guess of its
    # next tokens, `speculate.py`): positions [start + n, start + n + len(draft))
    draft: list[int] | None = None

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the context, so the step samples a token."""
        return self.req.kind == "generate" and self.start + self.n == len(self.req.ctx.tokens)


# A request whose next blocks another request computes in this step waits for the next
# step (and takes them from the prefix cache) when they hold at least this many tokens
# (SmolLM2 on 2 cores: 64 tokens ~65 ms of a step, a decode step ~35 ms).
DEDUPE_MIN_TOKENS = 64


def _urgency(req: Request) -> tuple[int, int]:
    return req.priority, req.seq


class Scheduler:
    """Decides what each step computes; owns the running and waiting sets."""

    def __init__(
        self,
        pool: BlockPool,
        *,
        max_num_seqs: int,
        max_batched_tokens: int,
        copy_block: Callable[[int, int], None],
        contexts: dict[Hashable, Context],
        background_tokens: int | None = None,
        background_every: int = 0,
        background_share: float = 0.25,
        background_wait: float = 0.0,
        linger: float = 0.0,
        hold: float = 0.0,
        speculate: int = 0,
        speculate_rows: int = 0,
        max_model_len: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pool = pool
        self.contexts = contexts  # all live contexts: idle ones' KV is evictable
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        if background_tokens is None:
            background_tokens = max(16, max_batched_tokens // 8)
        self.background_tokens = background_tokens
        self.background_every = background_every
        self.urgent_steps = 0  # steps planned with more and less urgent work both running
        # seconds after a more urgent request ends during which steps stay as small as
        # the background's turn: the next call of its chain is likely on its way
        self.linger = linger
        self.background_share = background_share
        # the longest less urgent work waits for its turn beside more urgent work (0: no
        # limit), and when it last had one (or had the engine to itself)
        self.background_wait = background_wait
        self._background_turn = clock()
        # of the linger, the seconds in which less urgent work waits for the next call
        self.hold = hold
        self._now = clock
        self._lingering: tuple[int, float] | None = None  # (priority, until)
        self._held_until = 0.0
        # when the last plan held less urgent work back: the time to plan again (the loop
        # waits for a new request or this, whichever comes first); None: not held
        self.wake_at: float | None = None
        # draft tokens per decode row (prompt lookup, `speculate.py`), in steps with
        # at most `speculate_rows` decode rows (0: never)
        self.speculate = speculate
        self.speculate_rows = speculate_rows
        self.max_model_len = max_model_len
        self.copy_block = copy_block  # copy-on-write: copy KV of block src into dst
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.preemptions = 0
        self.clock = 0  # steps planned; orders contexts by last use
        # forks that joined their parent's step in the last plan: id(fork's request) ->
        # (that request, the parent's fill): the fork's KV is good only if the fill's is
        self.joined: dict[int, tuple[Request, Request]] = {}
        self.joins = 0  # forks that joined their parent's step
        self.join_copied = 0  # parent tokens whose KV a step also wrote in a fork's block
        # the requests of a step paused between layers for more urgent work (`step_loop`):
        # they stay running, but no plan includes, preempts or evicts them until it ends;
        # `paused_priority` is the most urgent of them (None: no step is paused)
        self.paused: set[int] = set()
        self.paused_priority: int | None = None
        # set by a plan that found nothing more urgent than the paused step to run: the
        # loop resumes that step instead of running the (empty) plan
        self.resume_paused = False

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if self.linger > 0:
            now, last = self._now(), self._lingering
            if last is None or last[1] <= now or req.priority <= last[0]:
                self._lingering = (req.priority, now + self.linger)
                self._held_until = now + min(self.hold, self.linger)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[Work], list[Request], list[tuple[Request, Exception]]]:
        """Plan one step. Returns (work, finished fills, failed requests)."""
        finished: list[Request] = []
        failed: list[tuple[Request, Exception]] = []
        self.clock += 1
        self.wake_at = None
        self.resume_paused = False
        self._admit()
        if self.paused and not any(
            r.priority < self.paused_priority for r in self.running if id(r) not in self.paused
        ):
            # nothing more urgent than the paused step can run: it goes on (after the hold
            # of a more urgent request that just ended: the next call of its chain is
            # likely on its way, and the paused step would pause again for it)
            if (
                self._lingering is not None
                and self._lingering[0] < self.paused_priority
                and self._now() < self._held_until
            ):
                self.wake_at = self._held_until
            else:
                self.resume_paused = True
            return [], [], []
        budget = self.max_batched_tokens
        work: list[Work] = []
        planned: set[int] = set(self.paused)  # never preempted for this step's work
        computing: set[int] = set()  # chain hashes of the full blocks this step completes
        # those whose token scores a scoring fill keeps after this step, with its top k
        scoring: dict[int, tuple[int, int]] = {}
        # decodes first (one token each), then prefills; both by priority, then arrival
        order = sorted(
            (r for r in self.running if id(r) not in self.paused),
            key=lambda r: (r.pending > 1, r.priority, r.seq),
        )
        # the most urgent priority with work this step: less urgent work rides along in a
        # small share of the step only (the module doc)
        urgent = min(
            (r.priority for r in order if r.kind == "generate" or r.pending > 0), default=None
        )
        if self._lingering is not None:
            priority, until = self._lingering
            if self._now() >= until:
                self._lingering = None
            elif urgent is None or priority < urgent:
                urgent = priority  # a more urgent request just ended (see `linger`)
        background = 0
        if urgent is not None and any(r.priority > urgent for r in order):
            urgent_tokens = sum(
                1 if r.pending <= 1 else min(r.pending, budget)
                for r in order
                if r.priority == urgent
            )
            background = self.background_tokens + int(
                min(urgent_tokens, budget) * self.background_share
            )
            self.urgent_steps += 1
            if not urgent_tokens and self._now() < self._held_until:
                # lingering, in its hold: nothing is planned for less urgent work, and the
                # loop waits for the chain's next call (or the hold's end)
                background = 0
                self.wake_at = self._held_until
            elif not urgent_tokens:
                # lingering, nothing more urgent is here yet: the background's turn, so a
                # chain's next call waits for a small step at most, not a full one
                background = max(background, self.max_batched_tokens // 8, 1)
            elif (self.background_every and self.urgent_steps % self.background_every == 0) or (
                self.background_wait and self._now() - self._background_turn >= self.background_wait
            ):
                # the background's turn: all its decode rows, prefill in a small chunk (a
                # full chunk on a CPU is a ~1 s step, measured: the latency call waits it)
                background = max(background, self.max_batched_tokens // 8)
            if background >= self.max_batched_tokens // 8:
                self._background_turn = self._now()
        else:
            urgent = None
            self._background_turn = self._now()
        drafting = self.speculate > 0 and self._decode_rows(order, urgent, background) <= (
            self.speculate_rows
        )
        for req in order:
            if req not in self.running:
                continue  # preempted while planning an earlier request
            ctx = req.ctx
            behind = urgent is not None and req.priority > urgent
            if not req.matched and budget > 0 and not (behind and background < 1):
                # the prefix cache is asked when a request first gets room in a step, not
                # when it is admitted: requests that arrive together with one prompt are
                # admitted together, and the later ones find the blocks the first computed
                # meanwhile (8 concurrent 1,024-token prompts: the rest hit at admission only
                # where they came a step late, 4,600-8,200 of 8,200 tokens computed)
                scores = req.scores
                if scores is None:
                    self._match_prefix(ctx, len(ctx.tokens))
                else:
                    self._match_scored(ctx, scores)
                if (
                    scores is None
                    and self._in_flight(ctx, computing) >= DEDUPE_MIN_TOKENS
                    or scores is not None
                    and self._scored_in_flight(ctx, scoring, scores) > 0
                ):
                    # its next blocks are being computed in this step by another request: it
                    # starts next step and takes them from the cache. Not for a block or two
                    # (forks whose first own block holds the same text): a step more for
                    # the request would cost more than computing them twice. A scoring fill
                    # (an evaluation's, throughput work) waits for one block already: one
                    # context scored with 4 answers of ~50 tokens, 8 prompts a request, gave
                    # 1.92x the prompts/s of waiting from 64 tokens on (`scoring_choices.py`)
                    continue
                req.matched = True
            if req.kind == "generate" and req.pending == 0:
                if req.generated == 0 and ctx.kept_hidden() is not None:
                    # the fill that ended the prompt kept its last hidden state (this
                    # context's, or its parent's for a fork of exactly the parent's tokens):
                    # the first token is sampled from it, in this step, with nothing to compute
                    ctx.last_used = self.clock
                    work.append(Work(req, len(ctx.tokens), 0))
                    planned.add(id(req))
                    continue
                if behind and background < 1:
                    continue  # waits for a step with room for it
                ctx.num_computed -= 1  # logits of the last token are needed: recompute it
            if req.pending == 0:
                self.running.remove(req)
                finished.append(req)
                continue
            n = min(req.pending, budget)
            if behind:
                n = min(n, background)
                if n == 0:
                    continue  # its turn comes in a step with room (later, or no urgent work)
            if n == 0:
                break
            if not self._reserve(req, ctx.num_computed, n, planned):
                if not work and not self.paused:  # alone and too big: waiting never helps
                    # (a paused step's blocks come back when it ends)
                    self.running.remove(req)
                    failed.append(
                        (
                            req,
                            OutOfMemory(
                                f"the KV pool ({self.pool.num_blocks} blocks of "
                                f"{self.pool.block_size} "
                                f"tokens) cannot hold this request's {len(ctx.tokens)} tokens"
                            ),
                        )
                    )
                continue
            ctx.last_used = self.clock
            if self.pool.prefix_cache:
                bs = self.pool.block_size
                # block j - 1 ends in this chunk: its cache key is the chain hash of j blocks
                first, end = ctx.num_computed // bs + 1, (ctx.num_computed + n) // bs + 1
                computing.update(ctx.block_hash(j) for j in range(first, end))
                if req.scores is not None:
                    self._scoring(req.scores, ctx, first, end, scoring)
            draft = None
            if drafting and n == req.pending and not behind:  # its chunk ends the context
                draft = self._draft(req, budget - n)
                if draft and not self._room_for_draft(req, n, len(draft)):
                    draft = None
            work.append(Work(req, ctx.num_computed, n, draft=draft))
            planned.add(id(req))
            budget -= n + len(draft or ())
            if behind:
                background -= n
        self.joined = {}
        if budget > 0 and self.waiting:
            # forks whose parent's one queued request is a fill this step completes
            ends = {
                id(w.req.ctx): w
                for w in work
                if w.req.kind == "fill" and w.start + w.n == len(w.req.ctx.tokens)
            }
            for req in sorted(self.waiting, key=_urgency) if ends else ():
                if budget <= 0 or len(self.running) >= self.max_num_seqs:
                    break
                ctx = req.ctx
                if ctx.attached or ctx.queue[0] is not req:
                    continue
                filling = ends.get(id(ctx.parent))
                if filling is None or len(ctx.parent.queue) != 1:
                    continue
                behind = urgent is not None and req.priority > urgent
                if behind and background < 1:
                    continue
                self._attach(ctx, ctx.fork_len)
                self.joins += 1
                self.joined[id(req)] = (req, filling.req)
                if req.prompt_end is None:
                    req.prompt_end = len(ctx.tokens)
                req.matched = True  # its next blocks are this step's: nothing cached yet
                self.waiting.remove(req)
                self.running.append(req)
                ctx.last_used = self.clock
                n = min(req.pending, budget, background if behind else budget)
                if n <= 0 or not self._reserve(req, ctx.num_computed, n, planned):
                    continue  # joined: it goes on in a later step, from the parent's blocks
                self._copy_partial(ctx, filling)
                if self.pool.prefix_cache:
                    bs = self.pool.block_size
                    first, end = ctx.num_computed // bs + 1, (ctx.num_computed + n) // bs + 1
                    computing.update(ctx.block_hash(j) for j in range(first, end))
                work.append(Work(req, ctx.num_computed, n))
                planned.add(id(req))
                budget -= n
                if behind:
                    background -= n
        if self.paused and not work and self.wake_at is None:
            self.resume_paused = True  # nothing else can run (its blocks may be pinned)
        return work, finished, failed

    def _decode_rows(self, order: list[Request], urgent: int | None, background: int) -> int:
        """How many decode rows this step will have (the rows less urgent work may not
        take are left out)."""
        return sum(
            1
            for r in order
            if r.kind == "generate"
            and r.pending <= 1
            and not (urgent is not None and r.priority > urgent and background < 1)
        )

    def _draft(self, req: Request, room: int) -> list[int] | None:
        """Draft tokens for a decode row (`speculate.py`): at most `speculate`, no more than
        the step's room, the request's remaining tokens less one, and the model's length
        allow; None when the request may not draft or nothing matches. A constrained row
        drafts the tokens its grammar forces, else a prompt-lookup guess cut where the
        grammar stops allowing it."""
        drafter = req.drafter
        if drafter is None:
            return None
        k = min(self.speculate, room, req.sampling.max_tokens - req.generated - 1)
        ctx = req.ctx
        if self.max_model_len is not None:
            k = min(k, self.max_model_len - len(ctx.tokens) - 1)
        if req.sampling.constraint is None:
            return drafter.propose(ctx.tokens, k) or None
        grammar = req.sampler.grammar if req.sampler is not None else None
        if grammar is None or k <= 0:
            return None  # its grammar is bound in its first step
        draft = grammar.forced(k) or drafter.propose(ctx.tokens, k)
        return draft[: grammar.valid_prefix(draft)] or None

    def _room_for_draft(self, req: Request, n: int, d: int) -> bool:
        """Make the draft's positions writable from free blocks only: drafts never evict
        an idle context's KV or preempt a request (a guess is not worth it)."""
        ctx, bs = req.ctx, self.pool.block_size
        start = ctx.num_computed + n  # the draft's first position; [.., start) is reserved
        first, last = start // bs, (start + d - 1) // bs
        shared = sum(
            1
            for j in range(first, min(last + 1, len(ctx.blocks)))
            if self.pool.ref[ctx.blocks[j]] > 1
        )
        if self.pool.num_free < shared + max(0, last + 1 - len(ctx.blocks)):
            return False
        return self._reserve(req, start, d, set())

    def _admit(self) -> None:
        # by priority, then arrival (preempted requests keep their place): a latency call
        # or an API request is not queued behind a backlog of throughput work
        for req in sorted(self.waiting, key=_urgency):
            ctx = req.ctx
            if ctx.queue[0] is not req:
                continue  # an earlier request on this context goes first
            if not ctx.attached and ctx.parent.busy:
                continue  # fork once the parent's queued work is done
            if len(self.running) >= self.max_num_seqs and not self._make_way(req):
                return  # the rest are no more urgent than this one
            if not ctx.attached:
                self._attach(ctx)
            if req.prompt_end is None:
                req.prompt_end = len(ctx.tokens)
            self.waiting.remove(req)
            self.running.append(req)

    def _make_way(self, req: Request) -> bool:
        """A full running set admits a more urgent request by preempting the newest of its
        least urgent requests (which waits, its KV recomputed later); False if none is
        less urgent."""
        victim = max(
            (r for r in self.running if id(r) not in self.paused), key=_urgency, default=None
        )
        if victim is None or victim.priority <= req.priority:
            return False
        self.preempt(victim)
        return True

    def _attach(self, ctx: Context, upto: int | None = None) -> None:
        """Share the parent's blocks below the fork point: those it has computed, or (a
        fork joining the parent's step) those up to `upto`, which the step computes."""
        parent, bs = ctx.parent, self.pool.block_size
        n = min(parent.num_computed, ctx.fork_len) if upto is None else upto
        ctx.blocks = parent.blocks[: (n + bs - 1) // bs]
        for b in ctx.blocks:
            self.pool.incref(b)
        ctx.num_computed = n
        ctx.kept_blocks = n // bs
        ctx.attached = True
        grammar = parent.grammar
        if grammar is not None and grammar.end == ctx.fork_len:
            ctx.grammar = grammar.fork()  # the parent's grammar state at the fork point

    def _copy_partial(self, ctx: Context, filling: Work) -> None:
        """A joined fork that computes in the step has its own copy of the parent's partial
        last block (copy-on-write, before the step); the parent's tokens of that block
        which the step computes are written there too, as the parent's own KV."""
        bs = self.pool.block_size
        k = ctx.fork_len // bs
        if ctx.fork_len % bs == 0 or ctx.blocks[k] == ctx.parent.blocks[k]:
            return
        lo = max(k * bs, filling.start)
        if filling.copies is None:
            filling.copies = []
        base = ctx.blocks[k] * bs - k * bs
        filling.copies.extend((p, base + p) for p in range(lo, ctx.fork_len))
        self.join_copied += max(0, ctx.fork_len - lo)

    def unjoin(self, ctx: Context) -> None:
        """Drop every block of a fork whose parent's work failed in the step it joined:
        none of its KV is trusted (a later request recomputes all its tokens)."""
        for b in ctx.blocks:
            self.pool.decref(b)
        ctx.blocks = []
        ctx.num_computed = ctx.kept_blocks = 0

    def _match_prefix(self, ctx: Context, upto: int) -> None:
        """Take cached full blocks for the next uncomputed part of the context's first
        `upto` tokens.

        Also from inside a block: a fork whose parent ends mid-block holds the parent's
        partial block, and a cached full block with the same chain hash holds the same
        KV for those tokens and the fork's next ones, so it replaces the partial one
        (without this, a program's call forked from an unaligned prefix, as a system
        prompt rarely is aligned, recomputed its own tokens every time)."""
        bs = self.pool.block_size
        if not self.pool.prefix_cache:
            return
        while (ctx.num_computed // bs + 1) * bs <= upto:
            k = ctx.num_computed // bs
            toks = tuple(ctx.tokens[k * bs : (k + 1) * bs])
            block = self.pool.lookup(ctx.block_hash(k), toks)
            if block is None:
                return
            if k < len(ctx.blocks):
                self.pool.decref(ctx.blocks[k])
                ctx.blocks[k] = block
            else:
                ctx.blocks.append(block)
            ctx.num_computed = (k + 1) * bs

    def _match_scored(self, ctx: Context, scores: PromptScores) -> None:
        """`_match_prefix` for a scoring fill: the tokens before it as for any request, then
        the cached blocks holding its own tokens that a scoring fill kept scores for (a top
        k as large, entries for the tokens this fill scores), their entries copied into
        this fill's. It computes again the last position taken from the cache, whose
        logits give the next token's entry."""
        s, k, bs = scores.start, scores.k, self.pool.block_size
        self._match_prefix(ctx, s)
        if not self.pool.prefix_cache:
            return
        taken = False
        while (ctx.num_computed // bs + 1) * bs <= len(ctx.tokens):
            b = ctx.num_computed // bs
            need = max(0, s + 1 - b * bs)  # the block's first token the fill scores
            kept = None
            if need < bs:
                kept = self.pool.cached_scores(ctx.block_hash(b + 1), k, need)
                if kept is None:
                    break
            if (
                b < len(ctx.blocks)
                and self.pool.block_hash[ctx.blocks[b]] == ctx.block_hash(b + 1)
                and kept is not None
                and scores.entries[b * bs + bs - 1 - s] is not None
            ):
                # taken already (a fill matched again after waiting a step): its KV and
                # entries are in place, and the cache's counters have it
                ctx.num_computed = (b + 1) * bs
                taken = True
                continue
            block = self.pool.lookup(ctx.block_hash(b), tuple(ctx.tokens[b * bs : (b + 1) * bs]))
            if block is None:
                break
            if b < len(ctx.blocks):  # (a fork's partial block of its parent's: replaced)
                self.pool.decref(ctx.blocks[b])
                ctx.blocks[b] = block
            else:
                ctx.blocks.append(block)
            if kept is not None:
                for i in range(need, bs):
                    scores.entries[b * bs + i - s] = kept.entry(i, k)
                self.pool.scores_reused += bs - need
                taken = True
            ctx.num_computed = (b + 1) * bs
        if taken and ctx.num_computed < len(ctx.tokens):
            ctx.num_computed -= 1  # the last cached position's logits score the next token

    def _scoring(
        self,
        scores: PromptScores,
        ctx: Context,
        first: int,
        end: int,
        scoring: dict[int, tuple[int, int]],
    ) -> None:
        """Note the blocks j - 1 (j in [first, end)) that a scoring fill completes in this
        step and keeps scores for (`StepLoop._keep_scores`): hash -> (top k, the block's
        first token with an entry)."""
        s, bs = scores.start, self.pool.block_size
        for j in range(first, end):
            since = max(0, s + 1 - (j - 1) * bs)
            if since < bs:
                h = ctx.block_hash(j)
                k0, f0 = scoring.get(h, (-1, bs))
                scoring[h] = (max(k0, scores.k), min(f0, since))

    def _scored_in_flight(
        self, ctx: Context, scoring: dict[int, tuple[int, int]], scores: PromptScores
    ) -> int:
        """`_in_flight` for a scoring fill: its next blocks that this step completes with
        the scores it needs (`_scoring`)."""
        bs, s, k = self.pool.block_size, scores.start, scores.k
        j = ctx.num_computed // bs + 1
        while j * bs <= len(ctx.tokens):
            got = scoring.get(ctx.block_hash(j))
            if got is None or got[0] < k or got[1] > max(0, s + 1 - (j - 1) * bs):
                break
            j += 1
        return (j - 1 - ctx.num_computed // bs) * bs

    def _in_flight(self, ctx: Context, computing: set[int]) -> int:
        """Tokens of the context's next uncomputed full blocks that are among `computing`
        (the run of them from its first uncomputed block on)."""
        bs = self.pool.block_size
        j = ctx.num_computed // bs + 1
        while j * bs <= len(ctx.tokens) and ctx.block_hash(j) in computing:
            j += 1
        return (j - 1 - ctx.num_computed // bs) * bs

    def _reserve(self, req: Request, start: int, n: int, planned: set[int]) -> bool:
        """Make blocks [start, start + n) writable for this context, preempting if needed."""
        ctx, bs = req.ctx, self.pool.block_size
        first, last = start // bs, (start + n - 1) // bs
        shared = [
            j
            for j in range(first, min(last + 1, len(ctx.blocks)))
            if self.pool.ref[ctx.blocks[j]] > 1
        ]
        new = max(0, last + 1 - len(ctx.blocks))
        while self.pool.num_free < len(shared) + new:
            if not self._evict_one(req, planned):
                return False
            # the victim may have shared blocks with this context; recount
            shared = [
                j
                for j in range(first, min(last + 1, len(ctx.blocks)))
                if self.pool.ref[ctx.blocks[j]] > 1
            ]
        for j in shared:
            dst = self.pool.allocate()
            self.copy_block(ctx.blocks[j], dst)
            self.pool.decref(ctx.blocks[j])
            ctx.blocks[j] = dst
        for _ in range(new):
            ctx.blocks.append(self.pool.allocate())
        return True

    def _evict_one(self, req: Request, planned: set[int]) -> bool:
        """Free blocks for `req`: drop the KV of the least recently used context that is not
        running (its tokens stay; KV is recomputed when it is used again), else preempt the
        newest, least urgent running request not already in this step's batch."""
        running = {id(r.ctx) for r in self.running}
        idle = [
            c
            for c in self.contexts.values()
            if id(c) not in running
            and c is not req.ctx
            and any(self.pool.ref[b] == 1 for b in c.blocks[c.kept_blocks :])
        ]
        if idle:
            self.release(min(idle, key=lambda c: c.last_used))
            return True
        candidates = [r for r in self.running if id(r) not in planned and r is not req]
        if not candidates:
            return False
        self.preempt(max(candidates, key=lambda r: (r.priority, r.seq)))
        return True

    def release(self, ctx: Context) -> None:
        """Drop a context's unshared KV; its tokens stay and are recomputed on next use."""
        for b in ctx.blocks[ctx.kept_blocks :]:
            self.pool.decref(b)
        del ctx.blocks[ctx.kept_blocks :]
        ctx.num_computed = min(ctx.num_computed, ctx.kept_blocks * self.pool.block_size)

    def preempt(self, req: Request) -> None:
        """Release the request's unshared blocks; it recomputes them when it runs again."""
        ctx = req.ctx
        for b in ctx.blocks[ctx.kept_blocks :]:
            self.pool.decref(b)
        del ctx.blocks[ctx.kept_blocks :]
        ctx.num_computed = min(ctx.num_computed, ctx.kept_blocks * self.pool.block_size)
        self.running.remove(req)
        self.waiting.appendleft(req)
        req.matched = False  # asks the prefix cache again when it runs
        self.preemptions += 1
