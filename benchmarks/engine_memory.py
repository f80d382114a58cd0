"""Peak process memory serving the default model with the default KV pool.

.venv/bin/python benchmarks/engine_memory.py
"""

from __future__ import annotations

import asyncio
import resource

from parrot_backend.contract.sampling import SamplingParams
from parrot_backend.engine.engine import Engine
from parrot_backend.engine.runner import ModelRunner


async def serve_once(engine: Engine) -> None:
    async with engine:
        await engine.fill("a", None, engine.tokenize("Parrots are birds. " * 50))
        async for _ in engine.generate("a", None, SamplingParams(max_tokens=16)):
            pass


def main() -> None:
    engine = Engine.from_pretrained(progress=False)
    asyncio.run(serve_once(engine))
    s = engine.stats_now()
    per_block = ModelRunner.bytes_per_block(engine.runner.config, s.block_size, engine.dtype)
    print(f"KV pool: {s.blocks_total} blocks, {s.blocks_total * per_block / 2**20:.0f} MiB")
    print(f"peak RSS: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
