"""`parrot-backend` command line."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path


def _generate(args: argparse.Namespace) -> int:
    from parrot_backend.contract.errors import EngineError
    from parrot_backend.contract.sampling import SamplingParams
    from parrot_backend.server.engine_main import load_engine

    async def run() -> None:
        engine = load_engine(args)
        if args.raw or not engine.chat_template:
            prompt = engine.tokenize(args.prompt)
        else:
            text = engine.tokenizer.apply_chat_template(
                [{"role": "user", "content": args.prompt}],
                add_generation_prompt=True,
                tokenize=False,
            )
            prompt = engine.tokenize(text)
        sampling = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            stop=args.stop or [],
        )
        async with engine:
            await engine.fill("cli", None, prompt)
            async for delta in engine.generate("cli", None, sampling):
                sys.stdout.write(delta.text)
                sys.stdout.flush()
        sys.stdout.write("\n")

    try:
        asyncio.run(run())
    except (EngineError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _data_dir(arg: str | None) -> Path:
    """--data-dir, else $PARROT_DATA_DIR, else ~/.local/share/parrot-backend."""
    chosen = arg or os.environ.get("PARROT_DATA_DIR")
    if chosen:
        return Path(chosen).expanduser()
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "parrot-backend"


def _database_url(args: argparse.Namespace) -> str:
    """--database-url, else $PARROT_DATABASE_URL, else a SQLite file in the data dir."""
    url = args.database_url or os.environ.get("PARROT_DATABASE_URL")
    if url:
        return url
    data_dir = _data_dir(args.data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{data_dir / 'parrot.db'}"


def _serve(args: argparse.Namespace) -> int:
    """Run the HTTP server with the store, its engines (the in-process engine unless
    `--no-local-engine`, plus any `--upstream` servers; remote engines register later) and
    the native runtime; resume unfinished runs; exit non-zero if the in-process engine dies."""
    import logging

    import uvicorn

    from parrot_backend.contract.errors import EngineError
    from parrot_backend.server import ServerSettings, create_app
    from parrot_backend.server.engine_main import load_engine
    from parrot_backend.server.runtime import NativeRuntime
    from parrot_backend.server.settings import KEEP_ALIVE_S, is_loopback
    from parrot_backend.store import SchemaOutdatedError, Store, StoreError

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.gc_threshold is not None and args.gc_threshold < 0:
        print(f"error: --gc-threshold must be >= 0, got {args.gc_threshold}", file=sys.stderr)
        return 2
    from parrot_backend.server.auth import parse_api_keys

    try:
        # a key's tenant comes from the key (or its TENANT= name), never from its position
        keys = parse_api_keys(args.api_key or [])
    except ValueError as exc:
        print(f"error: --api-key: {exc}", file=sys.stderr)
        return 2
    # the store's keys count whenever auth is on; it is on with keys, on demand, off loopback
    auth = bool(keys) or args.auth or not is_loopback(args.host)
    try:
        store = Store(_database_url(args), upgrade=not args.no_upgrade)
    except SchemaOutdatedError as exc:
        print(f"error: {exc} (run without --no-upgrade to migrate it)", file=sys.stderr)
        return 2
    except StoreError as exc:
        print(f"error: database: {exc}", file=sys.stderr)
        return 2
    try:
        from parrot_backend.engines.upstream import serving as upstream_serving

        local = None if args.no_local_engine else load_engine(args)
        # --upstream servers (vLLM, SGLang, llama.cpp) run calls beside the local engine
        engines, engine, upstreams = upstream_serving.serve_engines(args, local)
        from parrot_backend.manager.manager import ManagerConfig

        limits = ManagerConfig(
            max_calls_per_run=args.max_calls_per_run, max_calls_per_tenant=args.max_calls_per_tenant
        )
        runtime = NativeRuntime(
            store,
            engines,
            worker=args.worker_id,
            owner_lease_s=args.run_lease,
            manager_config=limits,
            flush_interval_s=args.token_flush,
        )
        settings = ServerSettings(
            host=args.host,
            port=args.port,
            api_keys=keys,
            key_lookup=runtime.key_lookup if auth else None,
            auth=True if auth else None,
            manage_engine=True,
            salt_secret=runtime.salt_secret,
            max_body_bytes=args.max_body_bytes,
            max_inflight=args.max_inflight,
            max_inflight_per_tenant=args.max_inflight_per_tenant,
            max_prompts=args.max_prompts,
        )
        registry = None
        if args.operator_key:
            from parrot_backend.server.engine_registry import EngineRegistry

            # remote engines (`parrot-backend engine --manager URL`) join the manager here;
            # one that stops heartbeating is removed and its calls run elsewhere
            registry = EngineRegistry(
                operator_key=args.operator_key,
                model_name=runtime.manager.model,
                on_added=runtime.manager.add_engine,
                on_removed=runtime.manager.remove_engine,
            )
        app = create_app(engine, settings=settings, native=runtime, registry=registry)
    except (ValueError, FileNotFoundError, EngineError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        store.close()
        return 2
    if args.gc_threshold != 0:  # start-up is over: tune the collector for serving
        import gc

        from parrot_backend.manager.gctune import GEN0_THRESHOLD, configure_gc

        before = configure_gc(args.gc_threshold or GEN0_THRESHOLD)
        logging.getLogger("parrot_backend.cli").info(
            "gc: %d start-up objects frozen, generation-0 threshold %d (was %d)",
            gc.get_freeze_count(),
            gc.get_threshold()[0],
            before.thresholds[0],
        )
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level="info",
            timeout_graceful_shutdown=10,
            timeout_keep_alive=KEEP_ALIVE_S,
        )
    )
    failed: list[BaseException] = []

    async def watch() -> None:
        # a dead engine must stop the process with a failure code so a supervisor restarts it
        while not server.should_exit:
            await asyncio.sleep(0.5)
            if engine.error is not None:
                failed.append(engine.error)
                server.should_exit = True

    async def main() -> None:
        watcher = asyncio.create_task(watch())
        keeper = asyncio.create_task(  # an upstream that answers again goes back in service
            upstream_serving.keep_in_service(runtime.manager, upstreams)
        )
        try:
            await server.serve()
        finally:
            watcher.cancel()
            keeper.cancel()
            await upstream_serving.close(upstreams)

    try:
        asyncio.run(main())
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown
        pass
    finally:
        store.close()
    if failed:
        print(f"fatal: engine failed: {failed[0]!r}", file=sys.stderr)
        return 1
    return 0 if server.started else 1


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def _byte_size(text: str) -> int:
    """`1048576`, `512K`, `16M` or `1G` (binary units) -> bytes, at least 1 KiB."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = t[-1:] if t[-1:] in _SIZE_UNITS else ""
    try:
        value = int(t[: len(t) - len(unit)]) * _SIZE_UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected bytes such as 1048576, 512K, 16M or 1G, got {text!r}"
        ) from None
    if value < 1024:
        raise argparse.ArgumentTypeError(f"must be at least 1K (1024 bytes), got {text!r}")
    return value


def _flush_seconds(text: str) -> float:
    value = float(text)
    if not 0 < value <= 10:  # (also refuses nan and inf)
        raise argparse.ArgumentTypeError(f"must be > 0 and <= 10 seconds, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from parrot_backend.server.engine_main import add_engine_parser, add_model_arguments
    from parrot_backend.server.settings import DEFAULT_MAX_BODY_BYTES

    parser = argparse.ArgumentParser(prog="parrot-backend", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="stream a completion for one prompt")
    g.add_argument("prompt")
    add_model_arguments(g)  # --model, --dtype, --device, --num-blocks, --no-prefix-cache
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.set_defaults(func=_generate)
    s = sub.add_parser("serve", help="run the HTTP server (OpenAI-compatible and native API)")
    add_model_arguments(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument(
        "--api-key",
        action="append",
        metavar="[TENANT=]KEY",
        help="accept this Bearer key (repeatable; required off loopback). "
        "TENANT=KEY names its tenant (keys may share one); a bare KEY's "
        "tenant is key-<first 16 hex digits of its SHA-256>",
    )
    s.add_argument(
        "--auth",
        action="store_true",
        help="require API keys (static --api-key or the store's tenant keys) even on loopback",
    )
    s.add_argument(
        "--data-dir",
        default=None,
        help="where the SQLite database lives (default: $PARROT_DATA_DIR or "
        "~/.local/share/parrot-backend)",
    )
    s.add_argument(
        "--database-url",
        default=None,
        help="SQLAlchemy URL, e.g. postgresql+psycopg://user@host/db "
        "(default: $PARROT_DATABASE_URL or SQLite in the data dir)",
    )
    s.add_argument(
        "--no-upgrade",
        action="store_true",
        help="refuse to start on an older schema instead of migrating it",
    )
    s.add_argument(
        "--worker-id",
        default=None,
        help="this server's name in call claims (default: serve@<hostname>); "
        "keep it stable across restarts",
    )
    s.add_argument(
        "--run-lease",
        type=float,
        default=30.0,
        help="seconds this server holds its runs without renewing; servers "
        "sharing a database adopt the runs of one that stops (default 30)",
    )
    s.add_argument(
        "--token-flush",
        type=_flush_seconds,
        default=0.1,
        metavar="SECONDS",
        help="how often generated tokens are written to the store, which is when event "
        "streams send them: lower streams sooner, higher costs less CPU (default 0.1)",
    )
    s.add_argument(
        "--operator-key",
        default=os.environ.get("PARROT_OPERATOR_KEY"),
        help="accept remote engines that register with this key "
        "(default: $PARROT_OPERATOR_KEY; none: no remote engines)",
    )
    s.add_argument(
        "--max-calls-per-run",
        type=_positive,
        default=4096,
        metavar="N",
        help="calls one run may hold (a program, or an open run's additions in "
        "all); beyond: 400 (default 4096)",
    )
    s.add_argument(
        "--max-calls-per-tenant",
        type=_positive,
        default=4096,
        metavar="N",
        help="calls of one tenant ready or running at once; a run or calls that "
        "would start more: 429 with Retry-After (default 4096)",
    )
    s.add_argument(
        "--max-body-bytes",
        type=_byte_size,
        default=DEFAULT_MAX_BODY_BYTES,
        metavar="SIZE",
        help="largest request body accepted, e.g. 16M (K, M, G: binary units); beyond: "
        "413. A program carries each call's template whole: 64 calls sharing a "
        "6,144-token system prompt are ~1.8 MB (default 8M)",
    )
    s.add_argument(
        "--max-inflight",
        type=_positive,
        default=256,
        metavar="N",
        help="OpenAI-route requests generating at once (each prompt of a batch counts); "
        "beyond: 429 with Retry-After (default 256)",
    )
    s.add_argument(
        "--max-inflight-per-tenant",
        type=_positive,
        default=None,
        metavar="N",
        help="of those, the most one tenant holds at once; beyond: 429 for that tenant "
        "only (default: no per-tenant bound)",
    )
    s.add_argument(
        "--max-prompts",
        type=_positive,
        default=64,
        metavar="N",
        help="prompts in one /v1/completions request (a batch); beyond: 400 (default 64)",
    )
    s.add_argument(
        "--gc-threshold",
        type=int,
        default=None,
        metavar="N",
        help="garbage collector: freeze start-up objects and collect young "
        "objects every N allocations (default 10000, see "
        "parrot_backend/manager/gctune.py); 0 leaves Python's defaults",
    )
    from parrot_backend.engines.upstream.serving import add_arguments as upstream_arguments

    upstream_arguments(s)  # --upstream URL ..., --no-local-engine
    s.set_defaults(func=_serve)
    add_engine_parser(sub)  # `parrot-backend engine`: a remote engine process
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
