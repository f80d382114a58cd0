"""Decode over a shared prefix on the torch backend: grouped (the prefix's K/V read once per
step for every fork) vs plain (each fork gathers its whole context), SmolLM2, same run.

    .venv/bin/python benchmarks/shared_decode_cpu.py [--prefix 256 1024 2048] [--forks 2 8 16]

For each (prefix P, forks N): fill P tokens once, fork N children with an 8-token suffix
each, then time N concurrent greedy generations of `--gen` tokens; the two backends
alternate, `--reps` times, and the table gives the median decode step time of each and
their ratio (plain / grouped). Outputs are compared token for token on every pair.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch

from parrot_backend.contract.sampling import SamplingParams
from parrot_backend.engine.attention import TorchAttention
from parrot_backend.engine.engine import Engine
from parrot_backend.engine.model_files import resolve_model

TEXT = (
    "Parrots are intelligent birds found in tropical regions. They live in flocks, eat seeds "
    "and fruit, and some species can imitate human speech. "
)


class PlainTorch(TorchAttention):
    def share_prefix(self, prefix_len: int, group_size: int) -> bool:
        return False


async def one_run(engine: Engine, prefix: list[int], forks: int, gen: int, tag: str):
    sampling = SamplingParams(max_tokens=gen, ignore_eos=True)
    await engine.fill(f"{tag}p", None, prefix)
    for i in range(forks):
        await engine.fill(f"{tag}c{i}", f"{tag}p", engine.tokenize(f" Question {i}: why?"))
    steps0 = engine.stats_now().steps
    t0 = time.perf_counter()

    async def go(i: int) -> list[int]:
        return [d.token_id async for d in engine.generate(f"{tag}c{i}", None, sampling)]

    outs = await asyncio.gather(*(go(i) for i in range(forks)))
    dt = time.perf_counter() - t0
    steps = engine.stats_now().steps - steps0
    for i in range(forks):
        await engine.free(f"{tag}c{i}")
    await engine.free(f"{tag}p")
    return dt / max(steps, 1), outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefix", type=int, nargs="+", default=[256, 1024, 2048])
    ap.add_argument("--forks", type=int, nargs="+", default=[2, 8, 16])
    ap.add_argument("--gen", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    engine = Engine.from_pretrained(resolve_model(None), num_blocks=4096, progress=False)
    base = engine.tokenize(TEXT * 200)
    backends = {"grouped": TorchAttention(), "plain": PlainTorch()}
    rows = []

    async def bench() -> None:
        async with engine:
            await one_run(engine, base[:64], 2, 2, "warm")
            for p in args.prefix:
                for n in args.forks:
                    times: dict[str, list[float]] = {"grouped": [], "plain": []}
                    for rep in range(args.reps):
                        order = ["grouped", "plain"] if rep % 2 == 0 else ["plain", "grouped"]
                        got = {}
                        for name in order:
                            engine.runner.backend = backends[name]
                            step, outs = await one_run(
                                engine, base[rep : rep + p], n, args.gen, f"{name}{p}{n}{rep}"
                            )
                            times[name].append(step)
                            got[name] = outs
                        assert got["grouped"] == got["plain"], (p, n, rep)
                    g, pl = (statistics.median(times[k]) for k in ("grouped", "plain"))
                    rows.append((p, n, pl, g))
                    print(
                        f"P={p} N={n}: plain {pl * 1e3:.1f} ms/step, grouped {g * 1e3:.1f}, "
                        f"{pl / g:.2f}x",
                        flush=True,
                    )

    asyncio.run(bench())
    print(
        f"\ntorch threads {torch.get_num_threads()}, {args.gen} tokens per fork, "
        f"median of {args.reps}\n"
    )
    print("| prefix P | forks N | plain ms/step | grouped ms/step | plain / grouped |")
    print("| --- | --- | --- | --- | --- |")
    for p, n, pl, g in rows:
        print(f"| {p} | {n} | {pl * 1e3:.1f} | {g * 1e3:.1f} | {pl / g:.2f}x |")


if __name__ == "__main__":
    main()
