"""oneDNN's linear against PyTorch's F.linear under the engine's model (SmolLM2, CPU):
decode step time by batch rows, and prefill rate; one engine, the matmuls alternating:
`torch` (F.linear), `onednn-plain` (oneDNN on the plain weights, as 7946dc6 ran it) and
`onednn` (oneDNN on weights packed once into its layout, what the engine runs).

    .venv/bin/python benchmarks/cpu_linear.py [--rounds 3] [--dtype float32]

Each round runs, for each matmul in turn (order swapped every round): decode steps of
N = 1, 2, 3, 5, 8, 12 requests of 200-token prompts generating 12 tokens together (the
median time of the steps that decode all N), then a prefill of 256 and of 1,000 tokens
(the engine's prefix cache is off, so every prefill is computed in full).
Prints the medians over rounds and each as a ratio to torch (above 1: faster than torch),
and packed against plain oneDNN.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from parrot_backend.contract.sampling import SamplingParams
from parrot_backend.engine.engine import Engine
from parrot_backend.engine.models import linear
from parrot_backend.engine.threads import available_cores

TEXT = "Parrots are intelligent birds found in tropical regions. " * 120
ROWS = (1, 2, 3, 5, 8, 12)
PREFILL = (256, 1000)


async def main(rounds: int, dtype: str, threads: int) -> None:
    # a fixed thread count: the tuner switching counts mid-run would blur the comparison
    engine = Engine.from_pretrained(
        None, dtype=dtype, prefix_cache=False, progress=False, threads=threads
    )
    model = engine.runner.model
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

    async def decode(n: int) -> float:
        sampling = SamplingParams(max_tokens=12, ignore_eos=True)
        prefix = next(tag)

        async def one(i: int) -> None:
            cid = f"d{prefix}-{i}"
            await engine.fill(cid, None, base[i : i + 200])
            async for _ in engine.generate(cid, None, sampling):
                pass
            await engine.free(cid)

        steps.clear()
        await asyncio.gather(*(one(i) for i in range(n)))
        return statistics.median(dt for seqs, tokens, dt in steps if seqs == tokens == n)

    async def prefill(n: int) -> float:
        cid = f"p{next(tag)}"
        t = time.perf_counter()
        await engine.fill(cid, None, base[:n])  # no prefix cache: computed in full
        dt = time.perf_counter() - t
        await engine.free(cid)
        return n / dt

    kinds = ["onednn", "onednn-plain", "torch"]
    pack = linear.pack_weight

    def use(kind: str) -> None:
        model.use_linear("torch")  # plain weights back
        linear.pack_weight = pack if kind == "onednn" else (lambda w: w)
        model.use_linear(kind.removesuffix("-plain"))
        linear.pack_weight = pack

    got: dict[tuple[str, str], list[float]] = {}
    async with engine:
        use("torch")
        await decode(2)  # warm up
        for r in range(rounds):
            for kind in kinds if r % 2 == 0 else kinds[::-1]:
                use(kind)
                for n in ROWS:
                    got.setdefault((kind, f"decode {n:2d} rows ms"), []).append(
                        await decode(n) * 1000
                    )
                for n in PREFILL:
                    got.setdefault((kind, f"prefill {n:4d} tok/s"), []).append(await prefill(n))
            print(f"round {r + 1}/{rounds} done", flush=True)
    print(f"\n{engine.model_name}, {dtype}, {engine.threads.describe()}, {rounds} rounds")
    print(
        "| measure | torch (F.linear) | onednn plain | onednn packed "
        "| torch / plain | torch / packed | plain / packed |\n"
        "| --- | --- | --- | --- | --- | --- | --- |"
    )
    for name in [k for (kind, k) in got if kind == "torch"]:
        t, p, o = (statistics.median(got[k, name]) for k in ("torch", "onednn-plain", "onednn"))
        time_like = "ms" in name
        ratios = [a / b if time_like else b / a for a, b in ((t, p), (t, o), (p, o))]
        cells = " | ".join(f"{r:.2f}x" for r in ratios)
        print(f"| {name} | {t:.1f} | {p:.1f} | {o:.1f} | {cells} |")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=available_cores(), help="fixed (all cores)")
    args = p.parse_args()
    asyncio.run(main(args.rounds, args.dtype, args.threads))
