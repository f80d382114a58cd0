"""What returning log probabilities costs the engine: the same greedy decode with
`logprobs` off and with k alternatives, alternating in one run (SmolLM2-135M, CPU).

    .venv/bin/python benchmarks/logprobs_cost.py [--rows 8] [--tokens 32] [--reps 3] [--k 5]

Prints decode tokens/s of each side per repetition, the medians and their ratio (on/off).
Tokens are checked equal (logprobs never change what is generated).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from parrot_backend.contract.sampling import SamplingParams
from parrot_backend.engine.engine import Engine
from parrot_backend.engine.model_files import resolve_model

TEXT = "Parrots are intelligent birds found in tropical regions. They live in flocks. "


async def decode(engine: Engine, rows: int, tokens: int, k: int | None, tag: str):
    """Generate `tokens` for `rows` prompts at once; (tokens/s, token ids per row)."""
    base = engine.tokenize(TEXT * 20)
    sampling = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0, logprobs=k)

    async def one(i: int) -> list[int]:
        cid = f"{tag}{i}"
        await engine.fill(cid, None, base[i * 3 : i * 3 + 128])
        out = [d.token_id async for d in engine.generate(cid, None, sampling)]
        await engine.free(cid)
        return out

    t0 = time.perf_counter()
    got = await asyncio.gather(*(one(i) for i in range(rows)))
    return sum(map(len, got)) / (time.perf_counter() - t0), got


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--k", type=int, default=5, help="alternatives per token when on")
    args = ap.parse_args()
    engine = Engine.from_pretrained(resolve_model(None), dtype="float32", progress=False)
    await engine.start()
    try:
        await decode(engine, args.rows, 4, None, "warm")
        off, on = [], []
        for rep in range(args.reps):
            rate_off, tokens_off = await decode(engine, args.rows, args.tokens, None, f"a{rep}-")
            rate_on, tokens_on = await decode(engine, args.rows, args.tokens, args.k, f"b{rep}-")
            assert tokens_on == tokens_off, "logprobs changed the tokens"
            off.append(rate_off)
            on.append(rate_on)
            print(f"rep {rep}: off {rate_off:.1f} tok/s, on (k={args.k}) {rate_on:.1f} tok/s")
    finally:
        await engine.stop()
    m_off, m_on = statistics.median(off), statistics.median(on)
    print(f"median: off {m_off:.1f} tok/s, on {m_on:.1f} tok/s, on/off {m_on / m_off:.3f}")


if __name__ == "__main__":
    asyncio.run(main())
