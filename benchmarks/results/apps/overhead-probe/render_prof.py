"""Time (and profile) the dispatcher's rendering of shared_prompt's 8 calls, in process on
the converted SmolLM2 (no server): three runs of texts of their own, one token each.

    .venv/bin/python benchmarks/results/apps/overhead-probe/render_prof.py

Prints (calls, seconds) per rendering round, then the profile of all three rounds.
"""

import asyncio
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from appbench import workloads  # noqa: E402

from parrot_backend.engine.engine import Engine  # noqa: E402
from parrot_backend.engine.model_files import resolve_model  # noqa: E402
from parrot_backend.manager import dispatcher  # noqa: E402
from parrot_backend.manager.manager import Manager  # noqa: E402
from parrot_backend.program import RunSpec  # noqa: E402

prof = cProfile.Profile()
times: list[tuple[int, float]] = []
_render = dispatcher.Dispatcher._render


async def timed(self, ready):
    t = time.perf_counter()
    prof.enable()
    out = await _render(self, ready)
    prof.disable()
    times.append((len(ready), round(time.perf_counter() - t, 4)))
    return out


dispatcher.Dispatcher._render = timed


async def main() -> None:
    engine = Engine.from_pretrained(resolve_model(progress=False), num_blocks=2048, progress=False)
    async with engine, Manager({"e0": engine}) as m:
        for seed in (1, 2, 3):
            wl = workloads.build("shared_prompt", seed)
            calls = [c.spec() for c in wl.calls]
            for c in calls:
                for o in c.get("outputs", {}).values():
                    o["max_tokens"] = 1
            spec = RunSpec.model_validate(
                {
                    "program": {"calls": calls},
                    "inputs": wl.inputs,
                    "outputs": dict.fromkeys(wl.outputs, "latency"),
                }
            )
            rid = await m.create_run(spec)
            async for _ in m.subscribe(rid):
                pass
    print(times)


asyncio.run(main())
pstats.Stats(prof).sort_stats("cumulative").print_stats(15)
