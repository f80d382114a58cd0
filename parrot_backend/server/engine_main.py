"""`parrot-backend engine`: one engine in its own process, serving the engine API.

    parrot-backend engine --model PATH --api-key KEY [--host H --port P]
                          [--manager URL --manager-key OPKEY --engine-id ID]

Starts an in-process `Engine`, serves `create_engine_app` with uvicorn, and (with
`--manager`) registers with the manager's `EngineRegistry` and heartbeats, retrying with
backoff while the manager is down and registering again when the manager forgot it.
Exit status: 0 after a clean shutdown (SIGINT/SIGTERM; it deregisters first), 1 when the
engine loop dies (so a supervisor restarts it), 2 for bad arguments or when the manager
refuses it for good (wrong operator key, another model).

Keys may come from the environment instead of the command line (which `ps` shows):
`PARROT_ENGINE_API_KEY`, `PARROT_MANAGER_KEY`. Once listening, the process prints
`PARROT_ENGINE_URL=<url>` on stdout (useful with `--port 0`, which picks a free port).

`python -m parrot_backend.server.engine_main ...` runs it without the CLI entry point.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
import uuid
from typing import TYPE_CHECKING

import httpx

from ..engine.model_files import DEFAULT_MODEL

if TYPE_CHECKING:
    from ..engine.engine import Engine

log = logging.getLogger("parrot_backend.engine_main")


class Refused(Exception):
    """The manager refused this engine in a way retrying cannot fix."""


def add_engine_parser(subparsers) -> argparse.ArgumentParser:
    """Add the `engine` subcommand to the CLI's subparsers; it runs `run_engine`."""
    p = subparsers.add_parser("engine", help="run one engine process for a remote manager")
    _add_arguments(p)
    p.set_defaults(func=run_engine)
    return p


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments that load an in-process engine (`load_engine`): `engine`, and the
    CLI's `serve` and `generate`."""
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
    p.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="turn off the engine's token-level prefix cache (contexts forked from a "
        "shared prefix still share its KV)",
    )
    p.add_argument(
        "--urgent-linger",
        type=_seconds,
        default=0.25,
        metavar="SECONDS",
        help="after a request ends, less urgent work keeps to the small per-step turn for "
        "this long, so the next call of a latency chain does not wait for a full step of "
        "throughput work (default 0.25; 0: off)",
    )
    p.add_argument(
        "--linear",
        choices=("auto", "onednn", "torch"),
        default="auto",
        help="matmul of the model's projections: onednn (oneDNN's inner product on weights "
        "packed once, much faster than PyTorch's default on a CPU beyond one row) or "
        "torch (F.linear); auto: onednn on a CPU in float32 or bfloat16, torch elsewhere",
    )
    p.add_argument(
        "--background-tokens",
        type=_non_negative,
        default=None,
        metavar="N",
        help="tokens of less urgent (throughput) work a step carries beside more urgent "
        "work, plus --background-share of the urgent tokens (default: 0 on CPU, an eighth of the "
        "step budget on CUDA; docs/engine.md, Batching)",
    )
    p.add_argument(
        "--background-every",
        type=_non_negative,
        default=None,
        metavar="N",
        help="every N-th step beside more urgent work, less urgent work gets an eighth of "
        "the step budget; 0: only after --background-wait (default 0)",
    )
    p.add_argument(
        "--background-wait",
        type=_seconds,
        default=2.0,
        metavar="SECONDS",
        help="the longest less urgent work goes without its turn (an eighth of the step "
        "budget) while more urgent work runs, so a stream of latency calls never starves "
        "it (default 2.0; 0: no limit)",
    )
    p.add_argument(
        "--background-share",
        type=_fraction,
        default=None,
        metavar="F",
        help="less urgent work may add this share of the urgent work's tokens to a step "
        "(its decode rows count one token each; default: 0 on CPU, 0.25 on CUDA)",
    )
    p.add_argument(
        "--urgent-hold",
        type=_seconds,
        default=None,
        metavar="SECONDS",
        help="after a request ends, less urgent work waits this long (within the linger) "
        "before a step of its own, so the next call of a latency chain starts at once "
        "(default: 0.03 on CPU, 0 on CUDA; 0: off)",
    )
    p.add_argument(
        "--pause-steps",
        choices=("auto", "on", "off"),
        default="auto",
        help="a step of only less urgent (throughput) work pauses after a layer when more "
        "urgent work arrives, and goes on once that has run (default auto: on on CPU, off "
        "on CUDA; docs/engine.md, Batching)",
    )
    p.add_argument(
        "--speculate",
        type=_non_negative,
        default=None,
        metavar="N",
        help="draft tokens a generation checks per decode step, guessed from its own "
        "context (prompt lookup) or forced by its grammar; the output is what plain "
        "decoding gives; 0: off (default: 4 on CPU, 0 on CUDA; docs/engine.md, Drafts)",
    )
    p.add_argument(
        "--speculate-rows",
        type=_non_negative,
        default=None,
        metavar="N",
        help="draft only in steps with at most N decode rows (default: 2 on CPU)",
    )


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _fraction(text: str) -> float:
    value = _seconds(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be from 0 to 1, got {text}")
    return value


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def load_engine(args: argparse.Namespace) -> Engine:
    """The in-process engine the `add_model_arguments` arguments describe."""
    from ..engine.engine import Engine

    return Engine.from_pretrained(
        args.model,
        dtype=args.dtype,
        device=args.device,
        num_blocks=args.num_blocks,
        prefix_cache=not args.no_prefix_cache,
        background_tokens=args.background_tokens,
        background_every=args.background_every,
        linear=args.linear,
        urgent_linger=args.urgent_linger,
        urgent_hold=args.urgent_hold,
        pause_steps={"auto": None, "on": True, "off": False}[args.pause_steps],
        background_share=args.background_share,
        background_wait=args.background_wait,
        speculate=args.speculate,
        speculate_rows=args.speculate_rows,
    )


def _add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address the engine API listens on")
    p.add_argument("--port", type=int, default=8100, help="port (0: any free port)")
    p.add_argument(
        "--api-key",
        default=None,
        help="Bearer key of the engine API (default: $PARROT_ENGINE_API_KEY); "
        "required: the engine API is never open",
    )
    p.add_argument(
        "--manager",
        default=None,
        help="manager base URL to register with (e.g. http://10.0.0.1:8000)",
    )
    p.add_argument(
        "--manager-key",
        default=None,
        help="operator key for the manager's /v1/engines routes (default: $PARROT_MANAGER_KEY)",
    )
    p.add_argument(
        "--engine-id",
        default=None,
        help="this engine's id at the manager (default: <hostname>-<port>)",
    )
    p.add_argument(
        "--advertise-url",
        default=None,
        help="URL the manager should use to reach this engine "
        "(default: http://<host>:<port>; set it when --host is 0.0.0.0)",
    )
    p.add_argument(
        "--heartbeat-s",
        type=float,
        default=None,
        help="heartbeat period (default: what the manager asks for)",
    )


def _listen(host: str, port: int) -> socket.socket:
    # Bind ourselves so `--port 0` works: we learn the port before registering it.
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host.strip("[]"), port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


async def _manager_link(args, engine_id: str, url: str, api_key: str, model: str) -> None:
    """Register, then heartbeat; back off while the manager is unreachable or failing,
    register again when it answers 404 (it restarted or expired us). Raises Refused for
    answers retrying cannot fix."""
    headers = {"Authorization": f"Bearer {args.manager_key}"}
    body = {"engine_id": engine_id, "url": url, "model_name": model, "api_key": api_key}
    backoff, registered, period = 0.5, False, args.heartbeat_s or 2.0
    async with httpx.AsyncClient(
        base_url=args.manager.rstrip("/"), headers=headers, timeout=10.0, trust_env=False
    ) as client:
        while True:
            try:
                if not registered:
                    r = await client.post("/v1/engines/register", json=body)
                    if r.status_code in (401, 403, 409):
                        raise Refused(
                            f"manager refused registration ({r.status_code}): {r.text[:500]}"
                        )
                    r.raise_for_status()
                    registered = True
                    if args.heartbeat_s is None:
                        period = float(r.json().get("heartbeat_interval_s", period))
                    log.info("registered with %s as %s", args.manager, engine_id)
                else:
                    r = await client.post(f"/v1/engines/{engine_id}/heartbeat")
                    if r.status_code == 404:
                        log.warning("manager forgot engine %s; registering again", engine_id)
                        registered = False
                        continue
                    if r.status_code in (401, 403):
                        raise Refused(f"manager refused our heartbeat ({r.status_code})")
                    r.raise_for_status()
                backoff = 0.5
                await asyncio.sleep(period)
            except httpx.HTTPError as exc:
                log.warning("manager %s: %r; retrying in %.1fs", args.manager, exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 10.0)


async def _deregister(args, engine_id: str) -> None:
    try:
        async with httpx.AsyncClient(timeout=3.0, trust_env=False) as client:
            await client.delete(
                f"{args.manager.rstrip('/')}/v1/engines/{engine_id}",
                headers={"Authorization": f"Bearer {args.manager_key}"},
            )
    except httpx.HTTPError:
        pass  # the manager will expire us anyway


def run_engine(args: argparse.Namespace) -> int:
    """Run the engine process until shutdown; returns the exit status."""
    import uvicorn

    from .engine_api import create_engine_app
    from .settings import KEEP_ALIVE_S

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    api_key = args.api_key or os.environ.get("PARROT_ENGINE_API_KEY")
    if not api_key:
        print(
            "error: the engine API needs a key: --api-key or $PARROT_ENGINE_API_KEY",
            file=sys.stderr,
        )
        return 2
    args.manager_key = args.manager_key or os.environ.get("PARROT_MANAGER_KEY")
    if args.manager and not args.manager_key:
        print("error: --manager needs --manager-key or $PARROT_MANAGER_KEY", file=sys.stderr)
        return 2
    try:
        sock = _listen(args.host, args.port)
    except OSError as exc:
        print(f"error: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2
    port = sock.getsockname()[1]
    host = f"[{args.host}]" if ":" in args.host else args.host
    url = (args.advertise_url or f"http://{host}:{port}").rstrip("/")
    engine_id = args.engine_id or f"{socket.gethostname()}-{port}-{uuid.uuid4().hex[:6]}"
    try:
        engine = load_engine(args)
        app = create_engine_app(engine, api_key=api_key, manage_engine=True)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sock.close()
        return 2
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            log_level="warning",
            timeout_graceful_shutdown=5,
            timeout_keep_alive=KEEP_ALIVE_S,
        )
    )
    failures: list[str] = []

    async def watch_engine() -> None:
        # a dead engine loop must end the process with a failure status
        while not server.should_exit:
            await asyncio.sleep(0.25)
            if engine.error is not None:
                failures.append(f"engine failed: {engine.error!r}")
                server.should_exit = True

    async def link() -> None:
        while not server.started:
            await asyncio.sleep(0.05)
        print(f"PARROT_ENGINE_URL={url}", flush=True)
        if not args.manager:
            return
        try:
            await _manager_link(args, engine_id, url, api_key, engine.model_name)
        except Refused as exc:
            failures.append(str(exc))
            server.should_exit = True

    async def main() -> None:
        tasks = [asyncio.create_task(watch_engine()), asyncio.create_task(link())]
        try:
            await server.serve(sockets=[sock])
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if args.manager:  # tell the manager now rather than after missed heartbeats
                await _deregister(args, engine_id)

    def stop(signum, frame) -> None:
        # uvicorn handles these while it serves and re-raises them once it has shut down;
        # landing here then (or before it started) means "stop cleanly": exit status 0.
        server.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    try:
        asyncio.run(main())
    finally:
        sock.close()
    if failures:
        print(f"fatal: {failures[0]}", file=sys.stderr)
        return 1 if engine.error is not None else 2
    return 0 if server.started else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="parrot-backend engine",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_arguments(parser)
    return run_engine(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
