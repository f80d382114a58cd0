"""Where parrot's time outside engine steps goes on shared_prompt, against request-level:
when the first engine step starts after the client begins, gaps between steps (3 ms or
more listed as (ms, index)), and the time from the last step to the client's end.

    .venv/bin/python benchmarks/results/apps/overhead-probe/gaps.py URL PAIRS [SEED [WORKLOAD]]

URL: a bench server (`benchmarks/appbench/serve.py`), whose step log has each step's
`time.perf_counter()` (one clock for the processes of one machine). SEED (default 700)
picks the texts: a second probe on the same server needs another (at least 2 x PAIRS x 17
apart), or it finds the first one's prompts in the engine's cache. WORKLOAD: one of
`appbench/workloads.py` (default shared_prompt), at its CPU size, or with sizes of its own
as `NAME:KEY=N,...` (`shared_prompt:users=1,prompt=256`: the scaling sweep's one user).
"""

import asyncio
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from appbench import modes, workloads  # noqa: E402


async def main(url: str, pairs: int, seed: int = 700, name: str = "shared_prompt") -> None:
    name, _, sizes = name.partition(":")
    over = {k: int(v) for k, v in (kv.split("=") for kv in sizes.split(",") if kv)}
    async with httpx.AsyncClient(base_url=url, timeout=600, trust_env=False) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        for i in range(pairs):
            for mode in ("parrot", "request-level") if i % 2 == 0 else ("request-level", "parrot"):
                wl = workloads.build(name, seed + 17 * i + (mode == "parrot"), **over)
                mark = await modes.step_mark(http)
                t0 = time.perf_counter()
                if mode == "parrot":
                    got = await modes.run_parrot(http, wl, 0.0, counters=False)
                else:
                    got = await modes.run_request_level(http, wl, 0.0, model, counters=False)
                end = t0 + got["jct"]
                steps = (await http.get("/bench/steps", params={"after": mark})).json()["steps"]
                gaps = [
                    (round((b["t"] - a["t"] - a["dt"]) * 1e3), j)
                    for j, (a, b) in enumerate(zip(steps, steps[1:], strict=False))
                ]
                last = steps[-1]["t"] + steps[-1]["dt"]
                print(
                    f"{mode} {i}: jct {got['jct']:.3f} "
                    f"first step at +{(steps[0]['t'] - t0) * 1e3:.0f}ms, "
                    f"steps {len(steps)} busy {sum(s['dt'] for s in steps):.3f}, "
                    f"gaps sum {sum(g for g, _ in gaps)}ms big {[g for g in gaps if g[0] >= 3]}, "
                    f"after last step {(end - last) * 1e3:.0f}ms",
                    flush=True,
                )


if __name__ == "__main__":
    argv = sys.argv[1:]
    asyncio.run(main(argv[0], int(argv[1]), *([int(argv[2])] if argv[2:] else []), *argv[3:4]))
