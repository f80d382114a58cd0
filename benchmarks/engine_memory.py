"""Peak process memory serving the default model with the default KV pool.

    .venv/bin/python benchmarks/engine_memory.py
"""

import asyncio, resource
from parrot_backend.engine.engine import Engine
from parrot_backend.engine.sampling import SamplingParams
eng = Engine.from_pretrained(progress=False)
async def main():
    async with eng:
        await eng.fill("a", None, eng.tokenize("Parrots are birds. " * 50))
        async for _ in eng.generate("a", None, SamplingParams(max_tokens=16)): pass
asyncio.run(main())
s = eng.stats_now()
print("blocks", s.blocks_total, "pool MiB", s.blocks_total * eng.runner.bytes_per_block(eng.runner.config, 16, eng.dtype) / 2**20)
print("peak RSS MiB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
