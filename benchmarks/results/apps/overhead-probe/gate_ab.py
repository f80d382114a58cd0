"""The torch backend's decode gate, step by step on the engine alone: grouped vs plain.

    .venv/bin/python benchmarks/results/apps/overhead-probe/gate_ab.py \
        [--points 512x8 256x16 ...] [--gen 32]

For each point PxN: fill a P-token prefix, fork N users with a short suffix each and
generate `--gen` tokens each (ignoring EOS). Every decode step of all N rows switches the
gate between always grouping and never, so each grouped step has a plain neighbour on the
same contexts (the host's drift cancels). Prints both medians and the median of the
neighbours' plain/grouped ratios, and checks the tokens equal a plain run's.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch

from parrot_backend.contract.sampling import SamplingParams
from parrot_backend.engine.engine import Engine


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--points", nargs="+", default=["256x8", "256x16", "512x4", "512x8", "768x4", "1024x4"]
    )
    ap.add_argument("--gen", type=int, default=32)
    args = ap.parse_args()
    engine = Engine.from_pretrained(None, progress=False, prefix_cache=False)
    backend = engine.runner.backend
    compute = engine._compute
    state: dict = {"n": 0, "grouped": True, "last": None}
    times: dict[bool, list[float]] = {True: [], False: []}
    pairs: list[float] = []

    def timed(batch):
        if not len(batch.ids) == len(batch.seq_lens) == state["n"]:
            return compute(batch)
        grouped = state["grouped"]
        backend.share_prefix = (lambda p, n: True) if grouped else (lambda p, n: False)
        t = time.perf_counter()
        out = compute(batch)
        dt = time.perf_counter() - t
        times[grouped].append(dt)
        if state["last"] is not None:
            prev = state["last"]
            pairs.append(prev / dt if grouped else dt / prev)  # plain / grouped
            state["last"] = None
        else:
            state["last"] = dt
        state["grouped"] = not grouped
        return out

    sampling = SamplingParams(max_tokens=args.gen, ignore_eos=True)
    g = torch.Generator().manual_seed(0)

    async def program(prefix: list[int], n: int, tag: str) -> list[list[int]]:
        await engine.fill(f"{tag}p", None, prefix)

        async def user(i: int) -> list[int]:
            await engine.fill(f"{tag}u{i}", f"{tag}p", engine.tokenize(f" Question {i}: why?"))
            return [d.token_id async for d in engine.generate(f"{tag}u{i}", None, sampling)]

        outs = await asyncio.gather(*(user(i) for i in range(n)))
        for i in range(n):
            await engine.free(f"{tag}u{i}")
        await engine.free(f"{tag}p")
        return outs

    print(f"torch threads {torch.get_num_threads()}, {args.gen} tokens per user")
    async with engine:
        for point in args.points:
            p, n = map(int, point.split("x"))
            prefix = torch.randint(100, 40000, (p,), generator=g).tolist()
            backend.share_prefix = lambda p, n: False
            want = await program(prefix, n, f"plain{point}")
            engine._compute = timed
            state.update(n=n, grouped=True, last=None)
            times[True].clear(), times[False].clear(), pairs.clear()
            got = await program(prefix, n, f"ab{point}")
            engine._compute = compute
            assert got == want, f"{point}: grouped steps changed the tokens"
            q = statistics.quantiles(pairs, n=4)
            print(
                f"P={p:5d} N={n:3d} ({p * n:6d} prefix tokens): grouped "
                f"{statistics.median(times[True]) * 1e3:6.1f} ms, plain "
                f"{statistics.median(times[False]) * 1e3:6.1f} ms; median plain/grouped of "
                f"{len(pairs)} neighbours {statistics.median(pairs):.3f}x "
                f"(quartiles {q[0]:.3f}-{q[2]:.3f})",
                flush=True,
            )
    del backend.share_prefix  # the class's gate again


if __name__ == "__main__":
    asyncio.run(main())
