"""Scoring over HTTP as an evaluation harness sends it: lm-evaluation-harness's
`local-completions` loglikelihood request (`echo`, `logprobs` 1, `max_tokens` 1, token-id
prompts) against a real `parrot-backend serve`, three ways, alternating in one run:

- `single`: one prompt per request, one request at a time (`--batch_size 1`,
  `num_concurrent=1`, the harness's default);
- `concurrent`: one prompt per request, `--batch` requests at a time (`num_concurrent`);
- `batched`: `--batch` prompts per request (a list of token-id lists, `--batch_size`),
  one request at a time.

    .venv/bin/python benchmarks/scoring_http.py [--prompts 48] [--batch 8] [--reps 3]

Each mode of each repetition scores prompts of its own (no prefix-cache hit between
them). Prints prompts scored per second per mode and repetition, the medians, the ratios
to `single`, and checks that the three give the same log-likelihoods (same prompts
scored once more in each mode at the end).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
WORDS = (
    "parrot river clock lantern harbor meadow engine copper violin garden summit canyon "
    "signal pepper marble anchor forest ribbon comet island basket thunder"
).split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def texts(n: int, seed: int) -> list[str]:
    """`n` distinct question + answer texts of 40-80 words."""
    out = []
    for i in range(n):
        k = 40 + (seed * 31 + i * 17) % 41
        words = [WORDS[(seed * 7 + i * 13 + j * (i % 5 + 2)) % len(WORDS)] for j in range(k)]
        out.append(f"Question {seed}-{i}: what follows {words[0]}? Answer: " + " ".join(words))
    return out


class Client:
    def __init__(self, url: str, model: str) -> None:
        self.http = httpx.AsyncClient(base_url=url, timeout=600)
        self.model = model

    async def ids(self, text: str) -> list[int]:
        r = await self.http.post("/tokenize", json={"prompt": text})
        r.raise_for_status()
        return r.json()["tokens"]

    async def score(self, prompts: list[list[int]]) -> list[float]:
        """The harness's request; per prompt the sum of its token logprobs but the first
        and the generated one (what `parse_logprobs` sums with ctxlen 1)."""
        body = {
            "model": self.model,
            "prompt": prompts,
            "temperature": 0,
            "max_tokens": 1,
            "logprobs": 1,
            "seed": 1234,
            "echo": True,
        }
        r = await self.http.post("/v1/completions", json=body)
        r.raise_for_status()
        choices = sorted(r.json()["choices"], key=lambda c: c["index"])
        return [sum(c["logprobs"]["token_logprobs"][1:-1]) for c in choices]


async def run_mode(client: Client, mode: str, prompts: list[list[int]], batch: int):
    """(prompts/s, scores in order)."""
    t0 = time.perf_counter()
    if mode == "single":
        scores = [(await client.score([p]))[0] for p in prompts]
    elif mode == "concurrent":
        scores = []
        for i in range(0, len(prompts), batch):
            part = await asyncio.gather(*(client.score([p]) for p in prompts[i : i + batch]))
            scores += [s[0] for s in part]
    else:
        scores = []
        for i in range(0, len(prompts), batch):
            scores += await client.score(prompts[i : i + batch])
    return len(prompts) / (time.perf_counter() - t0), scores


async def bench(url: str, args: argparse.Namespace) -> None:
    async with httpx.AsyncClient(base_url=url) as probe:
        model = (await probe.get("/v1/models")).json()["data"][0]["id"]
    client = Client(url, model)
    modes = ["single", "concurrent", "batched"]
    rates: dict[str, list[float]] = {m: [] for m in modes}
    warm = [await client.ids(t) for t in texts(4, 999)]
    for mode in modes:
        await run_mode(client, mode, warm, args.batch)
    for rep in range(args.reps):
        order = modes if rep % 2 == 0 else modes[::-1]
        line = []
        for j, mode in enumerate(order):
            prompts = [await client.ids(t) for t in texts(args.prompts, rep * 10 + j)]
            rate, _ = await run_mode(client, mode, prompts, args.batch)
            rates[mode].append(rate)
            line.append(f"{mode} {rate:.2f}")
        print(f"rep {rep}: " + ", ".join(line) + " prompts/s", flush=True)
    same = [await client.ids(t) for t in texts(args.batch * 2, 500)]
    results = {m: (await run_mode(client, m, same, args.batch))[1] for m in modes}
    worst = max(
        abs(a - b) for m in modes[1:] for a, b in zip(results["single"], results[m], strict=True)
    )
    med = {m: statistics.median(v) for m, v in rates.items()}
    print("median prompts/s: " + ", ".join(f"{m} {v:.2f}" for m, v in med.items()))
    for m in modes[1:]:
        print(f"{m}/single {med[m] / med['single']:.2f}x")
    print(f"largest score difference between modes: {worst:.2e}")
    await client.http.aclose()


@contextlib.contextmanager
def serve(*serve_args: str):
    """A `parrot-backend serve` of this checkout on a free port (its URL), stopped after."""
    port = free_port()
    log = open(os.devnull, "w")  # noqa: SIM115 (held for the process's life)
    proc = subprocess.Popen(
        [sys.executable, "-m", "parrot_backend.cli", "serve", "--port", str(port), *serve_args],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("serve did not start")
            time.sleep(1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=48, help="prompts per mode and repetition")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--url", help="a running server (default: start `serve` here)")
    args = ap.parse_args()
    if args.url:
        asyncio.run(bench(args.url, args))
        return
    with serve() as url:
        asyncio.run(bench(url, args))


if __name__ == "__main__":
    main()
