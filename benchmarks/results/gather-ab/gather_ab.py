"""K/V gather A/B: advanced indexing (`flat[slots]`) vs `attention.gather` (index_select).

    .venv/bin/python benchmarks/results/gather-ab/gather_ab.py ROUNDS

One SmolLM2 engine (float32, 2 threads fixed, prefix cache off); the two gathers alternate
per round (order swapped each round); prints medians of the rounds and old / new.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time

from parrot_backend.contract.sampling import SamplingParams
from parrot_backend.engine import attention
from parrot_backend.engine.engine import Engine

TEXT = "Parrots are intelligent birds found in tropical regions. They live in flocks. " * 200
NEW = attention.gather


def old(flat, slots):
    return flat[slots]


async def main(rounds: int) -> None:
    engine = Engine.from_pretrained(None, prefix_cache=False, progress=False, threads=2)
    steps: list[tuple[int, int, float]] = []
    step = engine._step

    async def timed(work):
        t = time.perf_counter()
        out = await step(work)
        steps.append((len(work), sum(w.n for w in work), time.perf_counter() - t))
        return out

    engine._step = timed
    base = engine.tokenize(TEXT)
    tag = iter(range(10**9))
    sampling = SamplingParams(max_tokens=12, ignore_eos=True)

    async def drain(cid: str) -> None:
        async for _ in engine.generate(cid, None, sampling):
            pass

    async def decode(n: int, ctx: int) -> float:
        pre = next(tag)

        async def one(i: int) -> None:
            cid = f"d{pre}-{i}"
            await engine.fill(cid, None, base[i : i + ctx])
            await drain(cid)
            await engine.free(cid)

        steps.clear()
        await asyncio.gather(*(one(i) for i in range(n)))
        return statistics.median(dt for a, b, dt in steps if a == b == n) * 1e3

    async def forks(n: int, p: int, suffix: int) -> tuple[float, float]:
        pre = next(tag)
        await engine.fill(f"{pre}p", None, base[:p])
        steps.clear()
        await asyncio.gather(
            *(
                engine.fill(f"{pre}c{i}", f"{pre}p", base[p + i * 3 : p + i * 3 + suffix])
                for i in range(n)
            )
        )
        fill = sum(dt for a, b, dt in steps if a == n)
        steps.clear()
        await asyncio.gather(*(drain(f"{pre}c{i}") for i in range(n)))
        dec = statistics.median(dt for a, b, dt in steps if a == b == n)
        for i in range(n):
            await engine.free(f"{pre}c{i}")
        await engine.free(f"{pre}p")
        return fill * 1e3, dec * 1e3

    res: dict[tuple[str, str], list[float]] = {}
    async with engine:
        await decode(2, 100)
        for r in range(rounds):
            for kind in ("old", "new") if r % 2 == 0 else ("new", "old"):
                attention.gather = NEW if kind == "new" else old
                res.setdefault(("decode 1 x 300", kind), []).append(await decode(1, 300))
                res.setdefault(("decode 8 x 300", kind), []).append(await decode(8, 300))
                f, d = await forks(12, 1100, 20)
                res.setdefault(("12 forks of 1100: suffix fill", kind), []).append(f)
                res.setdefault(("12 forks of 1100: decode", kind), []).append(d)
    for name in dict.fromkeys(k for k, _ in res):
        a, b = statistics.median(res[name, "old"]), statistics.median(res[name, "new"])
        print(f"| {name} | {a:.1f} ms | {b:.1f} ms | {a / b:.2f}x |")


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1])))
