"""Upstreams in `parrot-backend serve`: the command-line options, connecting, and putting
an upstream that came back into service again.

    parrot-backend serve --upstream http://gpu-1:8000/v1 --upstream http://gpu-2:8000/v1 \
        [--upstream-model NAME] [--upstream-api-key-env VAR] [--upstream-tokenizer MODEL] \
        [--no-local-engine]

Each `--upstream` becomes one engine of the manager (`upstream-0`, `upstream-1`, ...), beside
the in-process engine unless `--no-local-engine`, and beside remote engines that register.
With the in-process engine the upstreams must serve its model: they are known by its name
and use its tokenizer, checked against their `/tokenize` at start.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
from collections.abc import Mapping
from typing import Any

from .engine import UpstreamEngine, connect_all

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The serve options for upstream engines."""
    parser.add_argument(
        "--upstream",
        action="append",
        default=[],
        metavar="URL",
        help="an OpenAI-compatible server to run calls on (vLLM, SGLang, "
        "llama.cpp: http://host:port/v1); repeatable",
    )
    parser.add_argument(
        "--upstream-model",
        default=None,
        metavar="NAME",
        help="the model name to send upstream (default: the first model each upstream lists)",
    )
    parser.add_argument(
        "--upstream-api-key-env",
        default=None,
        metavar="VAR",
        help="environment variable holding the upstreams' API key",
    )
    parser.add_argument(
        "--upstream-tokenizer",
        default=None,
        metavar="MODEL",
        help="a local model folder or name whose tokenizer the upstreams use "
        "(default: the in-process engine's, else the upstream's "
        "/tokenize)",
    )
    parser.add_argument(
        "--upstream-no-warm",
        action="store_true",
        help="do not warm a shared prefix upstream before its calls fan out",
    )
    parser.add_argument(
        "--no-local-engine",
        action="store_true",
        help="start no in-process engine (calls run on upstream or remote engines only)",
    )


def connect(args: argparse.Namespace, local: Any = None) -> dict[str, UpstreamEngine]:
    """Connect to every `--upstream` (before the server's event loop runs: the engines make
    their HTTP clients on first use). `local`: the in-process engine, whose name and
    tokenizer the upstreams take. Raises ValueError or EngineUnavailable."""
    if not args.upstream:
        return {}
    # httpx logs every request at INFO: one line per generation and per metrics scrape
    logging.getLogger("httpx").setLevel(logging.WARNING)
    api_key = None
    if args.upstream_api_key_env:
        api_key = os.environ.get(args.upstream_api_key_env)
        if not api_key:
            raise ValueError(f"--upstream-api-key-env: ${args.upstream_api_key_env} is not set")
    tokenizer = args.upstream_tokenizer
    if tokenizer is None and local is not None:
        tokenizer = local.tokenizer
    engines = asyncio.run(
        connect_all(
            args.upstream,
            api_key=api_key,
            model=args.upstream_model,
            tokenizer=tokenizer,
            model_name=local.model_name if local is not None else None,
            warm_prefixes=not args.upstream_no_warm,
        )
    )
    for i, engine in enumerate(engines):
        log.info("upstream-%d: %r, max %s tokens per request", i, engine, engine.max_model_len)
    return {f"upstream-{i}": e for i, e in enumerate(engines)}


def serve_engines(
    args: argparse.Namespace, local: Any = None
) -> tuple[dict[str, Any], Any, dict[str, UpstreamEngine]]:
    """What `serve` runs on: (the manager's engines, the engine of the OpenAI-compatible
    API, the upstreams). The in-process engine `local` (None with `--no-local-engine`) is
    `engine-0` and serves the OpenAI API; without it the first upstream does. Raises
    ValueError (no engine at all, bad options) or EngineUnavailable."""
    upstreams = connect(args, local)
    if local is None and not upstreams:
        raise ValueError("--no-local-engine needs at least one --upstream URL")
    engines: dict[str, Any] = {"engine-0": local} if local is not None else {}
    engines.update(upstreams)
    front = local if local is not None else next(iter(upstreams.values()))
    return engines, front, upstreams


async def keep_in_service(
    manager: Any, upstreams: Mapping[str, UpstreamEngine], interval_s: float = 5.0
) -> None:
    """Put back into service an upstream the manager took out (it was unreachable) once it
    answers again; its leftover contexts are dropped first. Runs until cancelled."""
    while True:
        await asyncio.sleep(interval_s)
        for engine_id, engine in upstreams.items():
            if engine_id in manager.engines or engine.closed:
                continue
            if await engine.health():
                await engine.reset()
                with contextlib.suppress(ValueError):  # (it raced another re-add)
                    manager.add_engine(engine_id, engine)
                    log.info("%s answers again: back in service", engine_id)


async def close(upstreams: Mapping[str, UpstreamEngine]) -> None:
    for engine in upstreams.values():
        await engine.aclose()
