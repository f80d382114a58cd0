"""The in-process engine: fill / generate / free / stats over a tree of KV contexts."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from parrot_backend.contract.engine import EngineStats, TokenDelta
from parrot_backend.contract.errors import (
    ContextBusy,
    ContextNotFound,
    EngineDead,
    EngineError,
    InvalidRequest,
    RequestCancelled,
    StepFailed,
)
from parrot_backend.contract.sampling import Constraint, SamplingParams

from .attention import make_backend
from .block_pool import BlockPool
from .context import Context, Request
from .detokenizer import Detokenizer
from .grammar import GrammarCompiler, GrammarError
from .model_files import DEFAULT_MODEL, resolve_model
from .models.loader import load_config, load_model
from .runner import Batch, ModelRunner, StepResult
from .sampler import Sampler, grammar_masks
from .scheduler import Scheduler, Work
from .threads import ThreadTuner, available_cores
from .tokens import decode_tokens, encode_segment, special_token_ids

log = logging.getLogger(__name__)

GiB = 1 << 30

_compute: ThreadPoolExecutor | None = None


def compute_executor() -> ThreadPoolExecutor:
    """The one thread that runs every torch operation of the engines in this process.

    On CPU, torch parallelises with OpenMP, and each calling thread gets its own team of
    worker threads. Once two threads have run torch code, the teams outnumber the cores
    and OpenMP stops spin-waiting: every matmul then wakes threads from sleep and runs
    about 1.8x slower (measured here on 2 cores), in every thread. Loading and computing
    on one dedicated thread keeps one team.
    """
    global _compute
    if _compute is None:
        _compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="parrot-compute")
    return _compute


@dataclass(slots=True)
class EngineConfig:
    """Engine settings; every field has a default that works on a laptop CPU."""

    model: str = DEFAULT_MODEL
    dtype: str = "auto"  # float32 on CPU, bfloat16 on CUDA
    device: str = "auto"
    block_size: int = 16
    num_blocks: int | None = None  # None: size the pool from memory
    kv_memory_fraction: float = 0.1  # of available memory, when num_blocks is None
    kv_memory_max_bytes: int = 1 * GiB  # cap on CPU, where memory is shared with everything
    max_num_seqs: int = 64
    max_batched_tokens: int = 512
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    prefix_cache: bool = True
    attention_backend: str = "auto"  # torch on CPU, triton on CUDA (when installed)
    threads: int | None = None  # CPU threads of torch ops; None: chosen by measuring steps


def _pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if name not in table:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(table)}")
    return table[name]


def _pick_backend(name: str, device: torch.device) -> str:
    if name != "auto":
        return name
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return "torch"
        return "triton"
    return "torch"


class Engine:
    """Serves one model. Create with `Engine.from_pretrained`, then `await start()`."""

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
        }
        self.eos_ids = frozenset(self._eos_ids(model_config, tokenizer))
        self.special_token_ids = special_token_ids(tokenizer)
        num_blocks = config.num_blocks or self._size_pool(model_config, dtype, device)
        self.pool = BlockPool(num_blocks, config.block_size, prefix_cache=config.prefix_cache)
        backend = make_backend(_pick_backend(config.attention_backend, device))
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
            self.threads = ThreadTuner(config.threads or available_cores(),
                                       fixed=config.threads is not None)
        else:  # torch's CPU threads barely matter next to a GPU: leave them alone
            self.threads = ThreadTuner(1, fixed=True, set_threads=lambda n: None)
        self.contexts: dict[Hashable, Context] = {}
        self.scheduler = Scheduler(
            self.pool,
            max_num_seqs=config.max_num_seqs,
            max_batched_tokens=config.max_batched_tokens,
            copy_block=self.runner.copy_block,
            contexts=self.contexts,
        )
        self._grammars: GrammarCompiler | None = None  # built by the first constraint
        self._grammars_lock: asyncio.Lock | None = None
        self.tokens_computed = 0
        self.tokens_generated = 0
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
        from transformers import AutoTokenizer

        config = EngineConfig(**overrides)
        if model is not None:
            config = replace(config, model=str(model))
        path = resolve_model(config.model, progress=progress)
        device = _pick_device(config.device)
        dtype = _pick_dtype(config.dtype, device)
        mconf = load_config(path)  # refuses unsupported architectures before any loading
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        max_pos = min(
            config.max_model_len or mconf.max_position_embeddings, mconf.max_position_embeddings
        )
        net, mconf = load_model(path, dtype, device, max_pos)
        name = DEFAULT_MODEL if config.model == DEFAULT_MODEL else Path(config.model).name
        return cls(net, mconf, tokenizer, config, device=device, dtype=dtype, model_name=name)

    def _size_pool(self, mconf, dtype: torch.dtype, device: torch.device) -> int:
        per_block = ModelRunner.bytes_per_block(mconf, self.config.block_size, dtype)
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = free * self.config.kv_memory_fraction
        else:
            import psutil

            available = psutil.virtual_memory().available
            budget = min(
                available * self.config.kv_memory_fraction, self.config.kv_memory_max_bytes
            )
        blocks = int(budget // per_block)
        if blocks < 1:
            raise EngineError(f"not enough memory for one KV block ({per_block} bytes)")
        return blocks

    @staticmethod
    def _eos_ids(mconf, tokenizer) -> set[int]:
        ids = set()
        for src in (getattr(mconf, "eos_token_id", None), tokenizer.eos_token_id):
            if isinstance(src, int):
                ids.add(src)
            elif isinstance(src, (list, tuple)):
                ids.update(int(i) for i in src)
        return ids

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
    ) -> int:
        """Append tokens to a context and compute their KV; returns the context length."""
        self._check_alive()
        if not isinstance(token_ids, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in token_ids
        ):
            raise InvalidRequest("token_ids must be a list of integers")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(
                f"token ids outside the vocabulary (0..{self.vocab_size - 1}): {bad[:5]}"
            )
        ctx = self._context_for(context_id, parent_id, salt)
        self._check_length(ctx, len(token_ids), 0)
        self._register(ctx)
        ctx.tokens.extend(token_ids)
        req = Request(
            "fill", ctx, future=asyncio.get_running_loop().create_future(), priority=priority
        )
        self._submit(req)
        try:
            return await asyncio.shield(req.future)
        except asyncio.CancelledError:
            self._cancel(req)
            raise

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
        ctx = self._context_for(context_id, parent_id, salt)
        if not ctx.tokens:
            raise InvalidRequest("cannot generate from an empty context: fill it first")
        self._check_length(ctx, 0, 1)
        self._register(ctx)
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
        ctx = self._get(context_id)
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
            tokens_generated=self.tokens_generated,
            preemptions=s.preemptions,
            steps=self.steps,
        )

    def context_tokens(self, context_id: Hashable) -> list[int]:
        return list(self._get(context_id).tokens)

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
                        GrammarCompiler, self.tokenizer, self.vocab_size, self.eos_ids)
        return self._grammars

    async def _compile(self, constraint: Constraint) -> None:
        """Compile a constraint before its request is queued, off the event loop (a large
        schema takes milliseconds); a refused one raises GrammarError (InvalidRequest)."""
        compiler = await self.grammar_compiler()
        if not compiler.is_cached(constraint):
            await asyncio.to_thread(compiler.compile, constraint)

    def _bind_grammar(self, req: Request) -> None:
        """Give a constrained request its grammar state when it first runs: the context's
        own state if it continues one (same constraint, nothing filled since, not finished;
        a fork's copy of its parent's counts), else a fresh one."""
        ctx, constraint = req.ctx, req.sampling.constraint
        state = ctx.grammar
        if (state is None or state.key != constraint.key or state.end != len(ctx.tokens)
                or state.stopped):
            state = self._grammars.start(constraint, len(ctx.tokens))
            ctx.grammar = state
        req.sampler.grammar = state

    # ----------------------------------------------------------------- internals
    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineDead(f"engine failed: {self.error!r}")
        if self._task is None:
            raise EngineError("engine not started: await engine.start() first")

    def _get(self, context_id: Hashable) -> Context:
        try:
            return self.contexts[context_id]
        except (KeyError, TypeError):
            raise ContextNotFound(
                f"unknown context {context_id!r} (never created or freed)"
            ) from None

    def _context_for(
        self, context_id: Hashable, parent_id: Hashable | None, salt: str | None
    ) -> Context:
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
        parent = self._get(parent_id) if parent_id is not None else None
        if parent_id is not None and parent_id == context_id:
            raise InvalidRequest("a context cannot be its own parent")
        # not registered yet: the caller validates the request, then calls _register
        return Context(context_id, parent, salt, self.pool.block_size)

    def _register(self, ctx: Context) -> None:
        if ctx.id not in self.contexts:
            self.contexts[ctx.id] = ctx
            if ctx.parent is not None:
                ctx.parent.children.add(ctx.id)

    def _check_length(self, ctx: Context, adding: int, generating: int) -> None:
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

    def _submit(self, req: Request) -> None:
        req.ctx.queue.append(req)
        self.scheduler.add(req)
        self._wake.set()

    def _cancel(self, req: Request) -> None:
        if req.done:
            return
        req.done = True
        self.scheduler.remove(req)
        if req in req.ctx.queue:
            req.ctx.queue.remove(req)
        if req.future is not None and not req.future.done():
            req.future.cancel()  # its caller was cancelled: nobody waits for an error
        self._wake.set()

    def _finish(self, req: Request) -> None:
        req.done = True
        self.scheduler.remove(req)
        if req in req.ctx.queue:
            req.ctx.queue.remove(req)
        self._wake.set()  # the next request on this context (or a child) may run now

    def _fail(self, req: Request, exc: BaseException) -> None:
        if req.done:
            return
        self._finish(req)
        if req.future is not None and not req.future.done():
            req.future.set_exception(exc)
        if req.out is not None:
            req.out.put_nowait(exc)

    async def _loop(self) -> None:
        try:
            while not self._stopping:
                work, finished, failed = self.scheduler.schedule()
                for req in finished:
                    self._finish(req)
                    req.future.set_result(len(req.ctx.tokens))
                for req, exc in failed:
                    self._fail(req, exc)
                if not work:
                    if finished or failed:
                        continue
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                if self._fail_at_step is not None and self.steps >= self._fail_at_step:
                    raise RuntimeError(f"injected fault at step {self.steps}")
                work = self._bind_grammars(work)
                self._postprocess(work, await self._step(work))
        except Exception as exc:  # a device failure or a bug: no request is at fault
            log.exception("engine loop died")
            self.error = exc
            for req in list(self.scheduler.running) + list(self.scheduler.waiting):
                self._fail(req, EngineDead(f"engine failed: {exc!r}"))

    def _bind_grammars(self, work: list[Work]) -> list[Work]:
        """Bind the grammar states of constrained requests starting in this step (on the loop
        thread, between steps: the compute thread never sees a state change under it)."""
        keep = work
        for w in work:
            req = w.req
            if req.sampler is None or req.sampler.grammar is not None:
                continue
            if req.sampling.constraint is None:
                continue
            try:
                self._bind_grammar(req)
            except GrammarError as exc:  # evicted from the cache and now refused: unlikely
                self._fail(req, exc)
                keep = [x for x in keep if x.req is not req]
        return keep

    async def _step(self, work: list[Work]) -> list[StepResult]:
        """Compute one step; returns each sequence's token, error or nothing.

        The step's inputs are copied out of the contexts before it runs (`prepare`), so a
        context freed or cancelled while it runs changes nothing it computes. A forward
        pass that fails is retried one sequence at a time: a request that breaks it fails
        alone (`StepFailed`) and the others go on. When every sequence fails alone too,
        a probe of the device decides: if the device is broken the loop dies (requests
        end with `EngineDead` and the manager keeps their calls), else the requests fail.
        """
        loop = asyncio.get_running_loop()
        runner = self.runner
        try:
            return await loop.run_in_executor(compute_executor(), self._compute,
                                              runner.prepare(work))
        except Exception as exc:
            log.warning("a step of %d sequence(s) failed (%r); retrying them one by one",
                        len(work), exc)
        results: list[StepResult] = []
        for w in work:
            if w.req.done or w.req.ctx.freed:  # cancelled or freed meanwhile: nothing to do
                results.append(None)
                continue
            try:
                results.extend(await loop.run_in_executor(
                    compute_executor(), self._compute, runner.prepare([w])))
            except Exception as exc:
                results.append(StepFailed(f"computing this request failed: {exc!r}"))
        if all(isinstance(r, BaseException) for r in results):
            await loop.run_in_executor(compute_executor(), self._probe_device)
        return results

    def _compute(self, batch: Batch) -> list[StepResult]:
        """One step on the compute thread, with the thread count the tuner picks."""
        constrained = [s for s in batch.samplers if s is not None and s.grammar is not None]
        if constrained:  # one bitmask for every constrained row of the step
            masks = grammar_masks([s.grammar for s in constrained], self.vocab_size)
            for sampler, mask in zip(constrained, masks, strict=True):
                sampler.banned = mask
        threads = self.threads.before_step()
        began = time.perf_counter()
        out = self.runner.execute(batch)
        self.threads.after_step(threads, time.perf_counter() - began, len(batch.ids))
        return out

    def _probe_device(self) -> None:
        """Raise if the device itself is broken (a CUDA error poisons every later op)."""
        x = torch.ones(8, device=self.device, dtype=self.dtype)
        if float((x * 2).sum().item()) != 16.0:
            raise EngineError("device probe computed a wrong result")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _postprocess(self, work: list[Work], sampled: list[StepResult]) -> None:
        self.steps += 1
        bs = self.pool.block_size
        for w, token in zip(work, sampled, strict=True):
            req, ctx = w.req, w.req.ctx
            if isinstance(token, BaseException):
                # this request's computation failed (the step ran without it): its KV is
                # not trusted, so nothing is marked computed
                if not isinstance(token, EngineError):
                    token = StepFailed(f"sampling this request failed: {token!r}")
                self._fail(req, token)
                continue
            self.tokens_computed += w.n
            if ctx.freed:
                continue
            before = ctx.num_computed
            ctx.num_computed = w.start + w.n
            for k in range(before // bs, ctx.num_computed // bs):
                # publish blocks that just became full for the token-level prefix cache
                self.pool.register(
                    ctx.blocks[k], ctx.block_hash(k), tuple(ctx.tokens[k * bs : (k + 1) * bs])
                )
            if req.done:
                continue  # cancelled while the step ran
            if req.kind == "fill":
                if req.pending == 0:
                    self._finish(req)
                    req.future.set_result(len(ctx.tokens))
                continue
            if token is None:
                continue
            self._emit(req, token)

    def _emit(self, req: Request, token: int) -> None:
        ctx, p = req.ctx, req.sampling
        req.generated += 1
        self.tokens_generated += 1
        finish = None
        grammar = req.sampler.grammar
        if token in req.eos_ids or token in p.stop_token_ids:
            text = req.detok.flush()
            finish = "stop"
        else:
            ctx.tokens.append(token)
            text = req.detok.add(token)
            if grammar is not None:
                try:
                    grammar.consume(token)
                except GrammarError as exc:
                    self._fail(req, exc)
                    return
                grammar.end = len(ctx.tokens)
            if req.detok.stopped:
                finish = "stop"
            elif grammar is not None and grammar.stopped:
                text += req.detok.flush()
                finish = "stop"  # the grammar allows nothing more: done without an EOS step
            elif req.generated >= p.max_tokens or len(ctx.tokens) >= self.max_model_len:
                if grammar is not None and p.constraint.require_complete and not grammar.accepting:
                    self._fail(req, GrammarError(
                        f"the {p.constraint.kind} constraint was not complete after "
                        f"{req.generated} tokens (max_tokens={p.max_tokens}); raise max_tokens"))
                    return
                text += req.detok.flush()
                finish = "length"
        if finish is not None:
            self._finish(req)
        req.out.put_nowait(TokenDelta(token, text, finish))
