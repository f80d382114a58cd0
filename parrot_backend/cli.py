"""`parrot-backend` command line."""

from __future__ import annotations

import argparse
import asyncio
import sys

from parrot_backend.engine.model_files import DEFAULT_MODEL


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="local checkpoint folder, .gguf file, or the default model name",
    )
    p.add_argument("--dtype", default="auto", help="float32 | bfloat16 | float16 | auto")
    p.add_argument("--device", default="auto", help="cpu | cuda | auto")
    p.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="KV pool size in blocks (default: sized from free memory)",
    )


def _generate(args: argparse.Namespace) -> int:
    from parrot_backend.engine.engine import Engine
    from parrot_backend.engine.errors import EngineError
    from parrot_backend.engine.sampling import SamplingParams

    async def run() -> None:
        engine = Engine.from_pretrained(
            args.model, dtype=args.dtype, device=args.device, num_blocks=args.num_blocks
        )
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


def _serve(args: argparse.Namespace) -> int:
    """Run the HTTP server with one in-process engine; exit non-zero if the engine dies."""
    import logging

    import uvicorn

    from parrot_backend.engine.engine import Engine
    from parrot_backend.server import ServerSettings, create_app

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    keys = {k: f"tenant-{i}" for i, k in enumerate(args.api_key or [])}
    settings = ServerSettings(host=args.host, port=args.port, api_keys=keys,
                              auth=bool(keys) or None, manage_engine=True)
    try:
        settings.check()
        engine = Engine.from_pretrained(args.model, dtype=args.dtype, device=args.device,
                                        num_blocks=args.num_blocks)
        app = create_app(engine, settings=settings)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port,
                                           log_level="info", timeout_graceful_shutdown=10))
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
        try:
            await server.serve()
        finally:
            watcher.cancel()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown
        pass
    if failed:
        print(f"fatal: engine failed: {failed[0]!r}", file=sys.stderr)
        return 1
    return 0 if server.started else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="parrot-backend", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="stream a completion for one prompt")
    g.add_argument("prompt")
    _engine_args(g)
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.set_defaults(func=_generate)
    s = sub.add_parser("serve", help="run the HTTP server (OpenAI-compatible and native API)")
    _engine_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", action="append",
                   help="accept this Bearer key (repeatable); required off loopback")
    s.set_defaults(func=_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
