"""Multiple-choice scoring over HTTP as an evaluation harness sends it: each question's
context (a passage and a question) is scored with each of its answers, one
lm-evaluation-harness `local-completions` loglikelihood request per (context, answer)
(`echo`, `logprobs` 1, `max_tokens` 1, token-id prompts), against two real `serve`
processes side by side, alternating in one run:

- `kept`: the default server: a scoring fill keeps its blocks' token scores with the
  prefix cache, so the later answers of a question take the context's full blocks
  (KV and scores) instead of computing them;
- `recompute`: `serve --no-prefix-cache`: every request computes its whole prompt (what
  every scoring request did before scores were kept: a scoring fill took nothing from
  the cache).

Two ways of sending: `single` (one prompt per request, one request at a time, lm-eval's
default) and `batched` (`--batch` prompts per request, a question's answers side by side
in one request, `--batch_size`).

    .venv/bin/python benchmarks/scoring_choices.py [--questions 12] [--answers 4]
        [--context 256] [--batch 8] [--reps 3]

Each repetition of each server and way scores questions of its own (no cache hit between
runs). Prints prompts scored per second, prompt tokens computed per prompt (the engine's
counter), the medians and kept/recompute, and the largest difference between the two
servers' log-likelihoods of the same questions (scored once more on each at the end).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import time

import httpx
from scoring_http import WORDS, Client, serve

COMPUTED = re.compile(r"^parrot_engine_prefill_tokens_computed(?:_total)?(?:\{[^}]*\})? (\S+)$")


def questions(n: int, answers: int, context_words: int, seed: int) -> list[tuple[str, list[str]]]:
    """`n` (context, answers) pairs: a passage of about `context_words` words and a
    question, then `answers` short distinct answers."""
    out = []
    for i in range(n):
        passage = " ".join(
            WORDS[(seed * 11 + i * 7 + j * (i % 3 + 3)) % len(WORDS)] for j in range(context_words)
        )
        context = f"Passage {seed}-{i}: {passage}\nQuestion: which word comes next?\nAnswer:"
        opts = [
            " " + " ".join(WORDS[(seed + i * 5 + a * 3 + j) % len(WORDS)] for j in range(3 + a))
            for a in range(answers)
        ]
        out.append((context, opts))
    return out


async def computed(http: httpx.AsyncClient) -> float:
    text = (await http.get("/metrics")).text
    for line in text.splitlines():
        m = COMPUTED.match(line)
        if m:
            return float(m.group(1))
    raise SystemExit("no parrot_engine_prefill_tokens_computed in /metrics")


async def prompts_of(client: Client, qs: list[tuple[str, list[str]]]) -> list[list[int]]:
    """Token ids of each (context, answer), context first (as lm-eval encodes them)."""
    out = []
    for context, answers in qs:
        ctx = await client.ids(context)
        for answer in answers:
            out.append(ctx + await client.ids(answer))
    return out


async def run(client: Client, way: str, prompts: list[list[int]], batch: int):
    """(prompts/s, prompt tokens computed per prompt, scores in order)."""
    before = await computed(client.http)
    t0 = time.perf_counter()
    scores: list[float] = []
    if way == "single":
        for p in prompts:
            scores += await client.score([p])
    else:
        for i in range(0, len(prompts), batch):
            scores += await client.score(prompts[i : i + batch])
    rate = len(prompts) / (time.perf_counter() - t0)
    return rate, (await computed(client.http) - before) / len(prompts), scores


async def bench(urls: dict[str, str], args: argparse.Namespace) -> None:
    clients = {}
    for name, url in urls.items():
        async with httpx.AsyncClient(base_url=url) as probe:
            model = (await probe.get("/v1/models")).json()["data"][0]["id"]
        clients[name] = Client(url, model)
    servers, ways = list(urls), ["single", "batched"]
    rates = {(s, w): [] for s in servers for w in ways}
    work = {(s, w): [] for s in servers for w in ways}
    for client in clients.values():  # warm each server's paths
        warm = await prompts_of(client, questions(1, args.answers, 20, 999))
        for way in ways:
            await run(client, way, warm, args.batch)
    seed = 0
    for rep in range(args.reps):
        order = servers if rep % 2 == 0 else servers[::-1]
        line = []
        for way in ways:
            for name in order:
                seed += 1
                qs = questions(args.questions, args.answers, args.context, seed)
                prompts = await prompts_of(clients[name], qs)
                rate, per, _ = await run(clients[name], way, prompts, args.batch)
                rates[(name, way)].append(rate)
                work[(name, way)].append(per)
                line.append(f"{name}/{way} {rate:.2f} ({per:.0f} tok)")
        print(f"rep {rep}: " + ", ".join(line), flush=True)
    print("median prompts/s (prompt tokens computed per prompt):")
    for way in ways:
        med = {s: statistics.median(rates[(s, way)]) for s in servers}
        tok = {s: statistics.median(work[(s, way)]) for s in servers}
        print(
            f"  {way}: "
            + ", ".join(f"{s} {med[s]:.2f} ({tok[s]:.0f})" for s in servers)
            + f"; kept/recompute {med['kept'] / med['recompute']:.2f}x prompts/s,"
            f" {tok['recompute'] / tok['kept']:.2f}x fewer tokens"
        )
    same = questions(2, args.answers, args.context, 10_000)
    got = {}
    for name, client in clients.items():
        got[name] = (await run(client, "batched", await prompts_of(client, same), args.batch))[2]
        got[name] += (await run(client, "single", await prompts_of(client, same), 1))[2]
    worst = max(abs(a - b) for a, b in zip(got["kept"], got["recompute"], strict=True))
    print(f"largest log-likelihood difference, kept vs recompute: {worst:.2e}")
    for client in clients.values():
        await client.http.aclose()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--questions", type=int, default=12, help="per server, way and repetition")
    ap.add_argument("--answers", type=int, default=4)
    ap.add_argument("--context", type=int, default=256, help="passage words")
    ap.add_argument("--batch", type=int, default=8, help="prompts per request when batched")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    with serve() as kept, serve("--no-prefix-cache") as recompute:
        asyncio.run(bench({"kept": kept, "recompute": recompute}, args))


if __name__ == "__main__":
    main()
