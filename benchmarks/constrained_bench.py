"""Unconstrained vs constrained decode throughput on one engine, measured in the same run.

Each round runs a batch of greedy generations of a fixed length (`ignore_eos` for the free
runs; a regex that admits any `max_tokens` lowercase letters for the constrained ones, so
both generate exactly as many tokens), alternating free and constrained rounds so that
load on a shared CPU hits both alike. Reports tokens/s of each and their ratio.

    .venv/bin/python benchmarks/constrained_bench.py                 # SmolLM2 (default)
    .venv/bin/python benchmarks/constrained_bench.py --model DIR --batch 8 --tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from parrot_backend.contract.sampling import Constraint, SamplingParams
from parrot_backend.engine.engine import Engine


async def _round(engine: Engine, batch: int, sampling: SamplingParams, tag: str) -> float:
    prompt = engine.tokenize("Write a long word:")

    async def one(i: int) -> int:
        cid = f"{tag}-{i}"
        await engine.fill(cid, None, prompt)
        n = 0
        async for _ in engine.generate(cid, None, sampling):
            n += 1
        await engine.free(cid)
        return n

    began = time.perf_counter()
    counts = await asyncio.gather(*(one(i) for i in range(batch)))
    return sum(counts) / (time.perf_counter() - began)


async def main(args: argparse.Namespace) -> dict:
    engine = Engine.from_pretrained(args.model, progress=False)
    free = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    # exactly `tokens` tokens of letters: the grammar never ends the generation early
    regex = Constraint("regex", f"[a-z ]{{{args.tokens},{args.tokens * 16}}}")
    constrained = SamplingParams(max_tokens=args.tokens, constraint=regex)
    rates: dict[str, list[float]] = {"free": [], "constrained": []}
    async with engine:
        await _round(engine, args.batch, constrained, "warm")  # compile, warm caches
        await _round(engine, args.batch, free, "warm-free")
        for r in range(args.rounds):
            rates["free"].append(await _round(engine, args.batch, free, f"f{r}"))
            rates["constrained"].append(await _round(engine, args.batch, constrained, f"c{r}"))
    free_tps = statistics.median(rates["free"])
    cons_tps = statistics.median(rates["constrained"])
    return {
        "model": engine.model_name,
        "batch": args.batch,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "free_tok_s": round(free_tps, 1),
        "constrained_tok_s": round(cons_tps, 1),
        "constrained_over_free": round(cons_tps / free_tps, 3),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model dir (default: SmolLM2)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    print(json.dumps(asyncio.run(main(parser.parse_args()))))
