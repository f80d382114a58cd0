"""A/B of the torch backend's grouped fork prefill on the engine alone, program by program.

    .venv/bin/python benchmarks/results/apps/overhead-probe/prefill_ab.py \
        [--users 8] [--prompt 1024] [--rounds 6]

Fills `apps.py`'s shared_prompt system prompt, forks the users with their questions (the
question chunks are prefilled together, in one step or a few) and generates `--gen`
tokens each (ignoring EOS). Programs alternate `group_prefill` on and off (each pair on
the same prompt, the engine's prefix cache off); prints the medians of the question
steps' time (the steps that prefill the users' chunks) and of the whole program, the
median of the pairs' ratios, and checks that both settings give the same tokens.
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
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--gen", type=int, default=8)
    args = ap.parse_args()
    # no token-level prefix cache: the pair's second program would reuse the first's KV
    engine = Engine.from_pretrained(None, progress=False, prefix_cache=False)
    backend = engine.runner.backend
    compute = engine._compute
    steps: list[float] = []

    def timed(batch):
        prefill = sum(
            batch.query_start[i + 1] - batch.query_start[i] > 1 for i in range(len(batch.seq_lens))
        )
        t = time.perf_counter()
        out = compute(batch)
        if prefill > 1:  # the users' question chunks (the prompt is one sequence)
            steps.append(time.perf_counter() - t)
        return out

    sampling = SamplingParams(max_tokens=args.gen, ignore_eos=True)

    async def program(seed: int, tag: str) -> tuple[list[list[int]], float, float]:
        await engine.fill(f"{tag}p", None, engine.tokenize(texts.system_prompt(seed, args.prompt)))
        steps.clear()

        async def user(i: int) -> list[int]:
            q = texts.question(seed * 100 + i)
            await engine.fill(
                f"{tag}u{i}", f"{tag}p", engine.tokenize(f"\n\nUser: {q}\nAssistant: ")
            )
            return [d.token_id async for d in engine.generate(f"{tag}u{i}", None, sampling)]

        t = time.perf_counter()
        outs = await asyncio.gather(*(user(i) for i in range(args.users)))
        total = time.perf_counter() - t
        for i in range(args.users):
            await engine.free(f"{tag}u{i}")
        await engine.free(f"{tag}p")
        return outs, sum(steps), total

    res: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    ratios: list[float] = []
    engine._compute = timed
    async with engine:
        await program(6999, "warm")
        for r in range(args.rounds):
            pair = {}
            for on in (True, False)[:: 1 if r % 2 else -1]:
                backend.group_prefill = on
                pair[on] = await program(7000 + r, f"r{r}{on}")
                res[on].append(pair[on][1:])
            assert pair[True][0] == pair[False][0], "grouped prefill changed the tokens"
            ratios.append(pair[False][1] / pair[True][1])
    backend.group_prefill = True
    gq = statistics.median(x[0] for x in res[True])
    pq = statistics.median(x[0] for x in res[False])
    gt = statistics.median(x[1] for x in res[True])
    pt = statistics.median(x[1] for x in res[False])
    print(
        f"{args.users} users over a {args.prompt}-token prompt, {args.rounds} pairs: question "
        f"steps grouped {gq * 1e3:.0f} ms, plain {pq * 1e3:.0f} ms (median of pairs' "
        f"plain/grouped {statistics.median(ratios):.2f}x, each {[round(x, 2) for x in ratios]}); "
        f"program grouped {gt:.2f} s, plain {pt:.2f} s; tokens equal"
    )


if __name__ == "__main__":
    asyncio.run(main())
