"""Two users' chat answers decoding together (text that rarely copies its prompt) and one
chain-summary step alone (text that does), engine alone, drafts off / on alternating:
wall time per round, tokens equal. Greedy by default; `--temperature T` samples, seeded
per round (the same seed in both settings).

    .venv/bin/python benchmarks/results/apps/speculate-ab/chat_pair.py [--rounds 4]
        [--temperature 0.7]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from appbench import workloads  # noqa: E402

from parrot_backend.contract.sampling import SamplingParams  # noqa: E402
from parrot_backend.engine.engine import Engine  # noqa: E402


async def answer(engine, prompts, sampling, tag):
    async def one(i, p):
        await engine.fill(f"{tag}{i}", None, engine.tokenize(p))
        out = [d.token_id async for d in engine.generate(f"{tag}{i}", None, sampling)]
        await engine.free(f"{tag}{i}")
        return out

    t = time.perf_counter()
    out = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return time.perf_counter() - t, out


async def main(args):
    engines = {k: Engine.from_pretrained(None, speculate=k) for k in (0, 4)}
    for e in engines.values():
        await e.start()
    cases = {}
    for seed in range(args.rounds):
        chat = workloads.build("shared_prompt", 900 + seed, users=2, prompt=256)
        cases.setdefault("2 chat answers", []).append([c.render(chat.inputs) for c in chat.calls])
        chain = workloads.build("chain_summary", 900 + seed)
        values = {**chain.inputs, "s0": "(nothing yet)"}
        cases.setdefault("1 summary step", []).append([chain.calls[0].render(values)])
    for e in engines.values():
        await answer(e, ["warm up"], SamplingParams(max_tokens=4), "w")
    for name, rounds in cases.items():
        times = {0: [], 4: []}
        for r, prompts in enumerate(rounds):
            order = (0, 4) if r % 2 == 0 else (4, 0)
            got = {}
            sampling = SamplingParams(
                max_tokens=args.gen, ignore_eos=True, temperature=args.temperature, seed=r
            )
            for k in order:
                dt, got[k] = await answer(engines[k], prompts, sampling, f"{name}{r}{k}")
                times[k].append(dt)
            assert got[0] == got[4], "drafts changed the tokens"
        off, on = statistics.median(times[0]), statistics.median(times[4])
        s = engines[4].stats_now()
        print(
            f"{name}: off {off:.2f} s, on {on:.2f} s, off/on {off / on:.2f}x "
            f"(rounds {[round(a / b, 2) for a, b in zip(times[0], times[4], strict=True)]}); "
            f"drafts so far {s.draft_tokens_accepted}/{s.draft_tokens} kept",
            flush=True,
        )
    for e in engines.values():
        await e.stop()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--gen", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.0)
    asyncio.run(main(ap.parse_args()))
