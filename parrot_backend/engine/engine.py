"""The in-process engine: fill / generate / free / stats over a tree of KV contexts.

Its parts, one file each: settings (`config.py`), loading a checkpoint and sizing the KV
pool (`loading.py`), the context tree (`context_tree.py`), and the batching loop that
computes the requests (`step_loop.py`). This file checks each request and hands it over.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator, Hashable
from pathlib import Path

import torch

from parrot_backend.contract.engine import EngineStats, ScoredFill, TokenDelta
from parrot_backend.contract.errors import (
    ContextNotFound,
    EngineDead,
    EngineError,
    InvalidRequest,
    RequestCancelled,
)
from parrot_backend.contract.sampling import Constraint, SamplingParams, check_logprobs

from .attention import make_backend
from .block_pool import BlockPool
from .config import (
    EngineConfig,
    pick_backend,
    pick_background,
    pick_hold,
    pick_linger,
    pick_pause,
    pick_share,
    pick_speculate,
)
from .context import Context, PromptScores, Request
from .context_tree import ContextTree
from .detokenizer import Detokenizer
from .grammar import GrammarCompiler
from .loading import eos_ids, load, pool_blocks
from .models.linear import pick_linear
from .runner import ModelRunner
from .sampler import Sampler
from .scheduler import Scheduler
from .speculate import Drafter
from .step_loop import StepLoop, compute_executor
from .threads import ThreadTuner, available_cores
from .tokens import decode_tokens, encode_segment, special_token_ids

__all__ = ["Engine", "EngineConfig", "compute_executor"]


class Engine(StepLoop):
    """Serves one model. Create with `Engine.from_pretrained`, then `await start()`."""

    # a fork submitted while its parent's fill is queued (in order, on one event loop)
    # joins the step that completes the fill (`scheduler.py`): the manager need not wait
    # for a prefix's fill before submitting the call that forks from it
    joins_forks = True
    # `SamplingParams.logprobs` is honoured: deltas carry logprob and top_logprobs
    supports_logprobs = True
    # `fill(..., prompt_logprobs=k)` too: the fill scores the tokens it appends
    supports_prompt_logprobs = True

    def __init__(
        self,
        model,
        model_config,
        tokenizer,
        config: EngineConfig,
        *,
        device: torch.device,
        dtype: torch.dtype,
        model_name: str,
    ) -> None:
        self.config = config
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.device = device
        self.dtype = dtype
        self.vocab_size = model_config.vocab_size
        limit = model_config.max_position_embeddings
        self.max_model_len = min(config.max_model_len or limit, limit)
        self.chat_template: str | None = getattr(tokenizer, "chat_template", None)
        self.special_tokens = {
            "bos_token": tokenizer.bos_token or "",
            "eos_token": tokenizer.eos_token or "",
            "pad_token": tokenizer.pad_token or "",  # (for /tokenizer_info)
        }
        self.eos_ids = frozenset(eos_ids(model_config, tokenizer))
        self.special_token_ids = special_token_ids(tokenizer)
        num_blocks = config.num_blocks or pool_blocks(model_config, config, dtype, device)
        self.pool = BlockPool(num_blocks, config.block_size, prefix_cache=config.prefix_cache)
        self.linear = pick_linear(config.linear, device, dtype)
        model.use_linear(self.linear)
        backend = make_backend(pick_backend(config.attention_backend, device))
        self.runner = ModelRunner(
            model,
            model_config,
            num_blocks=num_blocks,
            block_size=config.block_size,
            dtype=dtype,
            device=device,
            backend=backend,
        )
        if device.type == "cpu":
            self.threads = ThreadTuner(
                config.threads or available_cores(), fixed=config.threads is not None
            )
        else:  # torch's CPU threads barely matter next to a GPU: leave them alone
            self.threads = ThreadTuner(1, fixed=True, set_threads=lambda n: None)
        self.tree = ContextTree(self.pool, self.max_model_len)
        self.contexts: dict[Hashable, Context] = self.tree.contexts
        background = pick_background(config, device)
        speculate = pick_speculate(config, device)
        self.scheduler = Scheduler(
            self.pool,
            max_num_seqs=config.max_num_seqs,
            max_batched_tokens=config.max_batched_tokens,
            copy_block=self.runner.copy_block,
            contexts=self.contexts,
            background_tokens=background[0],
            background_every=background[1],
            background_share=pick_share(config, device),
            background_wait=pick_linger(config.background_wait, "background_wait"),
            linger=pick_linger(config.urgent_linger),
            hold=pick_hold(config, device),
            speculate=speculate[0],
            speculate_rows=speculate[1],
            max_model_len=self.max_model_len,
        )
        self.pause_steps = pick_pause(config, device)
        self.steps_paused = 0
        self._paused = None
        self._pause_below = None
        self._pause_flag = threading.Event()
        self._grammars: GrammarCompiler | None = None  # built by the first constraint
        self._grammars_lock: asyncio.Lock | None = None
        self.tokens_computed = 0
        self.prefill_tokens_computed = 0  # of those, prompt tokens (not sampled ones' KV)
        self.tokens_generated = 0
        self.drafted = self.draft_accepted = 0
        self.ended = self._seen_ended = 0
        self.submitted = 0
        self.steps = 0
        self.error: BaseException | None = None  # set when the engine loop died
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._stopping = False
        # fault injection for supervisor tests: the loop dies at this step
        fail_at = os.environ.get("PARROT_FAULT_ENGINE_STEP")
        self._fail_at_step = int(fail_at) if fail_at else None

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_pretrained(
        cls, model: str | Path | None = None, *, progress: bool = True, **overrides
    ) -> Engine:
        """Load a local checkpoint (or the default SmolLM2) and size the KV pool.

        Loading runs on the compute thread, like every forward pass (see `compute_executor`).
        """
        return compute_executor().submit(cls._load, model, progress, overrides).result()

    @classmethod
    def _load(cls, model: str | Path | None, progress: bool, overrides: dict) -> Engine:
        got = load(model, progress, overrides)
        return cls(
            got.model,
            got.model_config,
            got.tokenizer,
            got.config,
            device=got.device,
            dtype=got.dtype,
            model_name=got.model_name,
        )

    # ----------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Start the batching loop on the running event loop."""
        if self._task is not None:
            return
        self._wake = asyncio.Event()
        self._stopping = False
        self._task = asyncio.create_task(self._loop(), name="parrot-engine-loop")

    async def stop(self) -> None:
        """Stop the loop; pending requests fail with RequestCancelled."""
        self._stopping = True
        if self._task is None:
            return
        self._wake.set()
        await self._task
        self._task = None
        for req in list(self.scheduler.running) + list(self.scheduler.waiting):
            self._fail(req, RequestCancelled("engine stopped"))

    async def __aenter__(self) -> Engine:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    # ----------------------------------------------------------------- primitives
    def tokenize(self, text: str, *, data: bool = False) -> list[int]:
        """Token ids for a text segment, without special tokens added; `data` (a value
        substituted into a template): special-token spellings stay plain text."""
        return encode_segment(self.tokenizer, text, data=data)

    def detokenize(self, token_ids: list[int]) -> str:
        return decode_tokens(self.tokenizer, token_ids)

    async def fill(
        self,
        context_id: Hashable,
        parent_id: Hashable | None,
        token_ids: list[int],
        *,
        salt: str | None = None,
        priority: int = 0,
        prompt_logprobs: int | None = None,
    ) -> int | ScoredFill:
        """Append tokens to a context and compute their KV; returns the context length.

        With `prompt_logprobs` k, a `ScoredFill`: the fill computes the tokens it appends
        and, in each prefill chunk, the lm-head and log-softmax over their positions
        (`ModelRunner._score_prompt`). The prefix cache serves the tokens before them, and
        of its own tokens the cached blocks whose scores an earlier scoring fill kept (a
        top k as large): their entries are copied, and the last position taken from the
        cache is computed again to score the next token (`Scheduler._match_scored`)."""
        self._check_alive()
        check_logprobs("prompt_logprobs", prompt_logprobs, self.vocab_size)
        if not isinstance(token_ids, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in token_ids
        ):
            raise InvalidRequest("token_ids must be a list of integers")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(
                f"token ids outside the vocabulary (0..{self.vocab_size - 1}): {bad[:5]}"
            )
        ctx = self.tree.open(context_id, parent_id, salt)
        self.tree.check_length(ctx, len(token_ids), 0)
        self.tree.register(ctx)
        req = Request(
            "fill", ctx, future=asyncio.get_running_loop().create_future(), priority=priority
        )
        if prompt_logprobs is not None:
            n = len(token_ids)
            req.scores = PromptScores(
                len(ctx.tokens), tuple(token_ids), prompt_logprobs, [None] * n
            )
        ctx.tokens.extend(token_ids)
        self._submit(req)
        try:
            length = await asyncio.shield(req.future)
        except asyncio.CancelledError:
            self._cancel(req)
            raise
        if req.scores is None:
            return length
        return ScoredFill(length, req.scores.entries)

    async def generate(
        self,
        context_id: Hashable,
        parent_id: Hashable | None,
        sampling: SamplingParams,
        *,
        salt: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[TokenDelta]:
        """Generate into a context; yields TokenDeltas, the last with finish_reason set.

        The generated tokens stay in the context. Closing the iterator early cancels the
        generation at the next step (the context keeps what was generated so far)."""
        self._check_alive()
        if not isinstance(sampling, SamplingParams):
            raise InvalidRequest("sampling must be a SamplingParams")
        sampling.validate(self.vocab_size)
        if sampling.constraint is not None:
            await self._compile(sampling.constraint)
        if parent_id is None and context_id not in self.contexts:
            raise ContextNotFound(
                f"unknown context {context_id!r}: generate continues an "
                f"existing context or forks a new one from a parent"
            )
        ctx = self.tree.open(context_id, parent_id, salt)
        if not ctx.tokens:
            raise InvalidRequest("cannot generate from an empty context: fill it first")
        self.tree.check_length(ctx, 0, 1)
        self.tree.register(ctx)
        req = Request(
            "generate",
            ctx,
            sampling=sampling,
            sampler=Sampler(sampling),
            detok=Detokenizer(self.detokenize, sampling.stop),
            out=asyncio.Queue(),
            priority=priority,
            eos_ids=frozenset() if sampling.ignore_eos else self.eos_ids,
        )
        if self.scheduler.speculate:
            req.drafter = Drafter()  # its decode steps may check drafts (`speculate.py`)
        self._submit(req)
        try:
            while True:
                item = await req.out.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            if not req.done:
                self._cancel(req)

    async def free(self, context_id: Hashable) -> None:
        """Release a context; blocks still held by other contexts stay alive."""
        self.tree.free(context_id)

    async def stats(self) -> EngineStats:
        return self.stats_now()

    def stats_now(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            block_size=self.pool.block_size,
            blocks_total=self.pool.num_blocks,
            blocks_used=self.pool.num_used,
            blocks_free=self.pool.num_free,
            blocks_cached=self.pool.num_cached_free,
            prefix_cache_enabled=self.pool.prefix_cache,
            prefix_cache_hits=self.pool.hits,
            prefix_cache_queries=self.pool.queries,
            contexts=len(self.contexts),
            running=len(s.running),
            waiting=len(s.waiting),
            tokens_computed=self.tokens_computed,
            prefill_tokens_computed=self.prefill_tokens_computed,
            draft_tokens=self.drafted,
            draft_tokens_accepted=self.draft_accepted,
            prompt_scores_reused=self.pool.scores_reused,
            tokens_generated=self.tokens_generated,
            preemptions=s.preemptions,
            steps=self.steps,
        )

    def context_tokens(self, context_id: Hashable) -> list[int]:
        return list(self.tree.get(context_id).tokens)

    # ----------------------------------------------------------------- constraints
    async def grammar_compiler(self) -> GrammarCompiler:
        """The compiler of this engine's tokenizer, built on first use (it takes about half
        a second: engines that never see a constraint never pay it)."""
        if self._grammars is None:
            if self._grammars_lock is None:
                self._grammars_lock = asyncio.Lock()
            async with self._grammars_lock:
                if self._grammars is None:
                    self._grammars = await asyncio.to_thread(
                        GrammarCompiler, self.tokenizer, self.vocab_size, self.eos_ids
                    )
        return self._grammars

    async def _compile(self, constraint: Constraint) -> None:
        """Compile a constraint before its request is queued, off the event loop (a large
        schema takes milliseconds); a refused one raises GrammarError (InvalidRequest)."""
        compiler = await self.grammar_compiler()
        if not compiler.is_cached(constraint):
            await asyncio.to_thread(compiler.compile, constraint)

    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineDead(f"engine failed: {self.error!r}")
        if self._task is None:
            raise EngineError("engine not started: await engine.start() first")
