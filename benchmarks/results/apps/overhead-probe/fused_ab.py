"""A/B of the torch backend's fused shared-prefix decode, step by step on the engine alone.

    .venv/bin/python benchmarks/results/apps/overhead-probe/fused_ab.py [--users 8] [--prompt 1024]

Fills `apps.py`'s shared_prompt system prompt, forks the users with their questions and
generates `--gen` tokens each (ignoring EOS); every decode step of all the users' rows
switches `fused_shared_decode` on and off in turn, so each fused step has an unfused
neighbour on the same context (the host's drift cancels). Prints the medians of both,
the median of the neighbours' ratios, and checks both settings give the same tokens as an
ungrouped run.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "benchmarks"))

from appbench import texts  # noqa: E402

from parrot_backend.contract.sampling import SamplingParams  # noqa: E402
from parrot_backend.engine.engine import Engine  # noqa: E402


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--gen", type=int, default=48)
    args = ap.parse_args()
    engine = Engine.from_pretrained(None, progress=False)
    backend = engine.runner.backend
    compute = engine._compute
    times: dict[bool, list[float]] = {True: [], False: []}
    pairs: list[float] = []
    state = {"fused": True, "last": None}

    def timed(batch):
        if not len(batch.ids) == len(batch.seq_lens) == args.users:
            return compute(batch)
        fused = state["fused"]
        backend.fused_shared_decode = fused
        t = time.perf_counter()
        out = compute(batch)
        dt = time.perf_counter() - t
        times[fused].append(dt)
        if state["last"] is not None:  # this step and the one before, other setting
            prev = state["last"]
            pairs.append(prev / dt if fused else dt / prev)
            state["last"] = None
        else:
            state["last"] = dt
        state["fused"] = not fused
        return out

    sampling = SamplingParams(max_tokens=args.gen, ignore_eos=True)

    async def program(seed: int, tag: str) -> list[list[int]]:
        await engine.fill(f"{tag}p", None, engine.tokenize(texts.system_prompt(seed, args.prompt)))

        async def user(i: int) -> list[int]:
            q = texts.question(seed * 100 + i)
            await engine.fill(
                f"{tag}u{i}", f"{tag}p", engine.tokenize(f"\n\nUser: {q}\nAssistant: ")
            )
            return [d.token_id async for d in engine.generate(f"{tag}u{i}", None, sampling)]

        outs = await asyncio.gather(*(user(i) for i in range(args.users)))
        for i in range(args.users):
            await engine.free(f"{tag}u{i}")
        await engine.free(f"{tag}p")
        return outs

    async with engine:
        await program(6999, "warm")
        gate = backend.share_prefix
        backend.share_prefix = lambda p, n: False  # the plain path's tokens, for the check
        want = await program(7000, "plain")
        backend.share_prefix = gate
        engine._compute = timed
        for r in range(args.rounds):
            got = await program(7000, f"ab{r}")
            assert got == want, "fused/unfused steps changed the tokens"
        engine._compute = compute
    f, u = statistics.median(times[True]), statistics.median(times[False])
    print(
        f"{args.users} rows over a {args.prompt}-token prompt, {len(times[True])} fused and "
        f"{len(times[False])} unfused decode steps: fused {f * 1e3:.1f} ms, unfused "
        f"{u * 1e3:.1f} ms; median unfused/fused of {len(pairs)} neighbours "
        f"{statistics.median(pairs):.3f}x (quartiles "
        f"{statistics.quantiles(pairs, n=4)[0]:.3f}-{statistics.quantiles(pairs, n=4)[2]:.3f}); "
        "tokens equal to the ungrouped run's"
    )


if __name__ == "__main__":
    asyncio.run(main())
