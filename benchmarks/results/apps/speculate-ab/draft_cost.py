"""What checking drafts costs a decode step: R greedy rows over ~300-token contexts, each
row checking d drafts that are always wrong (so every step yields one token per row, and
its time is the price of the d extra rows). Alternates d = 0 with each d, per R; prints
median step times and their ratio. Engine alone, SmolLM2-135M, the CPU defaults otherwise.

    .venv/bin/python benchmarks/results/apps/speculate-ab/draft_cost.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch

import parrot_backend.engine.engine as engine_mod
from parrot_backend.contract.sampling import SamplingParams
from parrot_backend.engine.engine import Engine
from parrot_backend.engine.speculate import Drafter


class Wrong(Drafter):
    def record(self, drafted, kept):  # always drafts: the cost is what is measured
        pass

    def propose(self, tokens, k):
        return [(tokens[-1] + 1 + i) % 49152 for i in range(k)]


async def steps(engine, rows: int, gen: int, tag: str) -> float:
    g = torch.Generator().manual_seed(len(tag))
    prompts = [torch.randint(3, 40000, (300,), generator=g).tolist() for _ in range(rows)]
    for i, p in enumerate(prompts):
        await engine.fill(f"{tag}{i}", None, p)
    stamps: list[float] = []

    async def one(i):
        async for _ in engine.generate(
            f"{tag}{i}", None, SamplingParams(max_tokens=gen, ignore_eos=True)
        ):
            if i == 0:
                stamps.append(time.perf_counter())

    await asyncio.gather(*(one(i) for i in range(rows)))
    for i in range(rows):
        await engine.free(f"{tag}{i}")
    gaps = [b - a for a, b in zip(stamps[1:], stamps[2:], strict=False)]
    return statistics.median(gaps)


async def main(args) -> None:
    engine_mod.Drafter = Wrong
    engines = {d: Engine.from_pretrained(None, speculate=d, speculate_rows=64) for d in args.drafts}
    for e in engines.values():
        await e.start()
    for e in engines.values():  # first-use costs
        await steps(e, 1, 8, "warm")
    print("rows | drafts | step ms (drafts 0) | step ms (drafts d) | ratio")
    for rows in args.rows:
        for d in args.drafts:
            if d == 0:
                continue
            base, drafted = [], []
            for r in range(args.rounds):
                base.append(await steps(engines[0], rows, args.gen, f"b{rows}{d}{r}"))
                drafted.append(await steps(engines[d], rows, args.gen, f"d{rows}{d}{r}"))
            b, x = statistics.median(base), statistics.median(drafted)
            print(f"{rows} | {d} | {b * 1e3:.1f} | {x * 1e3:.1f} | {x / b:.2f}x", flush=True)
    for e in engines.values():
        await e.stop()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 8])
    ap.add_argument("--drafts", type=int, nargs="+", default=[0, 2, 4, 6])
    ap.add_argument("--gen", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    asyncio.run(main(ap.parse_args()))
