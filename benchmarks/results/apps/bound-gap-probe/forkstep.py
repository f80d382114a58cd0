"""Where shared_prompt's parrot JCT exceeds its lower bound: one engine step of 8 forks'
suffixes (14 tokens each) over a 1,024-token prefix, against the same 112 tokens as one
continuation of a 1,024-token context, and against 112 tokens with no context before
them. SmolLM2, the engine alone, random token ids (no drafts), 4 repetitions.

    .venv/bin/python benchmarks/results/apps/bound-gap-probe/forkstep.py
"""

import asyncio
import random
import sys
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from appbench.serve import _record_steps  # noqa: E402

from parrot_backend.engine.engine import Engine  # noqa: E402
from parrot_backend.engine.model_files import resolve_model  # noqa: E402

P, N, S = 1024, 8, 14


async def main() -> None:
    engine = Engine.from_pretrained(resolve_model(None), num_blocks=4096, progress=False)
    log: deque = deque()
    _record_steps(engine, log)
    random.seed(0)
    base = [random.randrange(1000, 20000) for _ in range(4000)]

    def steps() -> list[tuple[int, int]]:
        out = [(r["tokens"], round(r["dt"] * 1e3)) for r in log]
        log.clear()
        return out

    async with engine:
        for rep in range(4):
            await engine.fill(f"p{rep}", None, base[rep : rep + P])
            log.clear()
            await asyncio.gather(
                *(
                    engine.fill(
                        f"f{rep}{i}", f"p{rep}", base[2000 + i * S + rep : 2000 + (i + 1) * S + rep]
                    )
                    for i in range(N)
                )
            )
            forks = steps()
            await engine.fill(f"q{rep}", None, base[100 + rep : 100 + rep + P])
            log.clear()
            await engine.fill(f"r{rep}", f"q{rep}", base[3000 + rep : 3000 + rep + N * S])
            continuation = steps()
            await engine.fill(f"s{rep}", None, base[3500 + rep : 3500 + rep + N * S])
            alone = steps()
            print(
                f"(tokens, ms) forks {forks} | one continuation {continuation} | no prefix {alone}",
                flush=True,
            )
            for cid in [f"f{rep}{i}" for i in range(N)] + [f"r{rep}", f"q{rep}", f"p{rep}"]:
                await engine.free(cid)
            await engine.free(f"s{rep}")


asyncio.run(main())
