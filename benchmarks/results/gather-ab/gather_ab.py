import asyncio, statistics, time, sys
from parrot_backend.contract.sampling import SamplingParams
from parrot_backend.engine.engine import Engine
from parrot_backend.engine import attention
TEXT = "Parrots are intelligent birds found in tropical regions. They live in flocks. " * 200
new = attention.gather
old = lambda flat, slots: flat[slots]
async def main(R):
    engine = Engine.from_pretrained(None, prefix_cache=False, progress=False, threads=2)
    steps = []; step = engine._step
    async def timed(work):
        t = time.perf_counter(); out = await step(work)
        steps.append((len(work), sum(w.n for w in work), time.perf_counter() - t)); return out
    engine._step = timed
    base = engine.tokenize(TEXT); tag = iter(range(10**9))
    async def decode(n, ctx):
        s = SamplingParams(max_tokens=12, ignore_eos=True); pre = next(tag)
        async def one(i):
            cid = f"d{pre}-{i}"
            await engine.fill(cid, None, base[i:i+ctx])
            async for _ in engine.generate(cid, None, s): pass
            await engine.free(cid)
        steps.clear(); await asyncio.gather(*(one(i) for i in range(n)))
        return statistics.median(dt for a, b, dt in steps if a == b == n) * 1e3
    async def forks(n, P, suf):
        pre = next(tag)
        await engine.fill(f"{pre}p", None, base[:P])
        steps.clear()
        await asyncio.gather(*(engine.fill(f"{pre}c{i}", f"{pre}p", base[P+i*3:P+i*3+suf]) for i in range(n)))
        fill = sum(dt for a, b, dt in steps if a == n)
        s = SamplingParams(max_tokens=12, ignore_eos=True)
        async def go(i):
            async for _ in engine.generate(f"{pre}c{i}", None, s): pass
        steps.clear(); await asyncio.gather(*(go(i) for i in range(n)))
        dec = statistics.median(dt for a, b, dt in steps if a == b == n)
        for i in range(n): await engine.free(f"{pre}c{i}")
        await engine.free(f"{pre}p")
        return fill * 1e3, dec * 1e3
    res = {}
    async with engine:
        await decode(2, 100)
        for r in range(R):
            for kind in (("old", "new") if r % 2 == 0 else ("new", "old")):
                attention.gather = new if kind == "new" else old
                res.setdefault(("decode 1 x 300", kind), []).append(await decode(1, 300))
                res.setdefault(("decode 8 x 300", kind), []).append(await decode(8, 300))
                f, d = await forks(12, 1100, 20)
                res.setdefault(("12 forks of 1100: suffix fill", kind), []).append(f)
                res.setdefault(("12 forks of 1100: decode", kind), []).append(d)
    for name in dict.fromkeys(k for k, _ in res):
        a, b = statistics.median(res[name, "old"]), statistics.median(res[name, "new"])
        print(f"| {name} | {a:.1f} ms | {b:.1f} ms | {a/b:.2f}x |")
asyncio.run(main(int(sys.argv[1])))
