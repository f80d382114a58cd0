"""Decode step time by batch rows on the engine (SmolLM2, CPU), equal and unequal context
lengths: what one more decode row costs a step.

    .venv/bin/python benchmarks/decode_rows_cpu.py

For N in 1, 2, 3, 5, 8, 12 requests (prompts of 200 tokens, or 150 + 13 i), generate 12
tokens each together and print the median time of the steps that decode all N; two rounds.
"""

from __future__ import annotations

import asyncio
import statistics
import time

from parrot_backend.contract.sampling import SamplingParams
from parrot_backend.engine.engine import Engine

TEXT = "Parrots are intelligent birds found in tropical regions. " * 60


async def main() -> None:
    engine = Engine.from_pretrained(None, progress=False)
    steps: list[tuple[int, int, float]] = []
    step = engine._step

    async def timed(work):
        t = time.perf_counter()
        out = await step(work)
        steps.append((len(work), sum(w.n for w in work), time.perf_counter() - t))
        return out

    engine._step = timed
    base = engine.tokenize(TEXT)

    async def run(n: int, equal: bool, tag: str) -> float:
        sampling = SamplingParams(max_tokens=12, ignore_eos=True)

        async def one(i: int) -> None:
            length = 200 if equal else 150 + 13 * i
            await engine.fill(f"{tag}{i}", None, base[i : i + length])
            async for _ in engine.generate(f"{tag}{i}", None, sampling):
                pass
            await engine.free(f"{tag}{i}")

        steps.clear()
        await asyncio.gather(*(one(i) for i in range(n)))
        decode = [dt for seqs, tokens, dt in steps if seqs == n and tokens == n]
        return statistics.median(decode) if decode else float("nan")

    async with engine:
        await run(2, True, "warm")
        for rep in range(2):
            for n in (1, 2, 3, 5, 8, 12):
                for equal in (True, False):
                    ms = await run(n, equal, f"r{rep}-{n}-{equal}-") * 1000
                    kind = "equal" if equal else "unequal"
                    print(f"rows {n:2d} {kind:7s} {ms:6.1f} ms", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
