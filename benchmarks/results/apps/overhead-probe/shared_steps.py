"""The shared_prompt workload on the engine alone: every step's rows, tokens and time, and
where a decode step of N forks over the ~1,024-token system prompt spends its time.

    .venv/bin/python benchmarks/results/apps/overhead-probe/shared_steps.py [--rounds 2]

Per round: fill `apps.py`'s shared_prompt system prompt (seed 7000 + round), fork 8 users
with their questions, generate 16 tokens each (ignore EOS), and print the step log; then
one user alone on the same prompt (a batch-1 decode step over the same context). The
last round runs the 8 users again under torch's profiler and prints the ops' table for
the steps that decode all 8 rows.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "benchmarks"))

from appbench import texts  # noqa: E402

from parrot_backend.contract.sampling import SamplingParams  # noqa: E402
from parrot_backend.engine.engine import Engine  # noqa: E402


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--gen", type=int, default=16)
    args = ap.parse_args()
    engine = Engine.from_pretrained(None, progress=False)
    log: list[tuple[int, int, float]] = []
    step = engine._step

    async def timed(work):
        t = time.perf_counter()
        out = await step(work)
        log.append((len(work), sum(w.n for w in work), time.perf_counter() - t))
        return out

    engine._step = timed
    sampling = SamplingParams(max_tokens=args.gen, ignore_eos=True)

    async def program(seed: int, users: int, tag: str) -> float:
        system = texts.system_prompt(seed, args.prompt)
        await engine.fill(f"{tag}p", None, engine.tokenize(system))

        async def user(i: int) -> None:
            q = texts.question(seed * 100 + i)
            await engine.fill(
                f"{tag}u{i}", f"{tag}p", engine.tokenize(f"\n\nUser: {q}\nAssistant: ")
            )
            async for _ in engine.generate(f"{tag}u{i}", None, sampling):
                pass

        t = time.perf_counter()
        await asyncio.gather(*(user(i) for i in range(users)))
        dt = time.perf_counter() - t
        for i in range(users):
            await engine.free(f"{tag}u{i}")
        await engine.free(f"{tag}p")
        return dt

    def show(title: str, rows: int) -> list[float]:
        print(f"-- {title}: {len(log)} steps")
        for seqs, tokens, dt in log:
            print(f"   rows {seqs:2d} tokens {tokens:5d} {dt * 1e3:7.1f} ms")
        dec = [dt for seqs, tokens, dt in log if seqs == rows and tokens == rows]
        return dec

    async with engine:
        log.clear()
        await program(6999, 2, "warm")
        for r in range(args.rounds):
            log.clear()
            t0 = time.perf_counter()
            total = await program(7000 + r, args.users, f"r{r}")
            dec = show(f"round {r}, {args.users} users", args.users)
            log.clear()
            await program(7100 + r, 1, f"s{r}")
            one = show(f"round {r}, one user", 1)
            print(
                f"round {r}: {args.users} users {total:.2f} s; decode step median "
                f"{statistics.median(dec) * 1e3:.1f} ms ({args.users} rows) vs "
                f"{statistics.median(one) * 1e3:.1f} ms (1 row); threads "
                f"{torch.get_num_threads()}; {time.perf_counter() - t0:.1f} s",
                flush=True,
            )
        # the profile: torch's profiler records the thread it runs on, so each step on the
        # compute thread runs under a profiler of its own; ops summed over the steps that
        # decode exactly `users` rows
        from collections import defaultdict

        from torch.profiler import ProfilerActivity, profile

        compute = engine._compute
        for users in (args.users, 1):
            ops: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
            walls: list[float] = []

            def profiled(batch, users=users, ops=ops, walls=walls):
                if not len(batch.ids) == len(batch.seq_lens) == users:
                    return compute(batch)
                t = time.perf_counter()
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    out = compute(batch)
                walls.append(time.perf_counter() - t)
                for e in prof.key_averages():
                    ops[e.key][0] += e.self_cpu_time_total
                    ops[e.key][1] += e.count
                return out

            engine._compute = profiled
            await program(7200 + users, users, f"prof{users}")
            engine._compute = compute
            n = len(walls)
            print(
                f"\nprofiled {n} decode steps of {users} rows, wall median "
                f"{statistics.median(walls) * 1e3:.1f} ms (profiler on)"
            )
            total = sum(v[0] for v in ops.values()) / n / 1e3
            print(f"self CPU per step {total:.1f} ms; top ops (ms per step, calls per step):")
            for key, (us, cnt) in sorted(ops.items(), key=lambda kv: -kv[1][0])[:22]:
                print(f"  {us / n / 1e3:7.2f} ms {cnt / n:6.0f}  {key}")


if __name__ == "__main__":
    asyncio.run(main())
