"""Alternate parrot's shared_prompt at the --gpu sizes (64 users, 6,144 tokens) on two
running servers (`appbench/serve.py`, e.g. on the tiny model of `tiny_long_model.py`):

    .venv/bin/python benchmarks/results/apps/overhead-probe/gpu_sizes_ab.py \
        URL_BEFORE URL_AFTER ROUNDS
"""

import asyncio
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from appbench import modes, workloads

urls = dict(before=sys.argv[1], after=sys.argv[2])
rounds = int(sys.argv[3])


async def main():
    res = {k: [] for k in urls}
    clients = {
        k: httpx.AsyncClient(base_url=u, timeout=900, trust_env=False) for k, u in urls.items()
    }
    for c in clients.values():
        await modes.run_parrot(
            c, workloads.shared_prompt(1, users=4, prompt=512, gen=4, ignore_eos=True), 0.0
        )
    for r in range(rounds):
        order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
        for k in order:
            wl = workloads.build("shared_prompt", 900 + 10 * r + (k == "after"), gpu=True)
            t = time.time()
            await modes.run_parrot(clients[k], wl, 0.0)
            res[k].append(time.time() - t)
        print(r, {k: round(v[-1], 2) for k, v in res.items()}, flush=True)
    for k in res:
        print(k, "median JCT", round(statistics.median(res[k]), 2), [round(x, 2) for x in res[k]])
    print(
        "before/after", round(statistics.median(res["before"]) / statistics.median(res["after"]), 3)
    )


asyncio.run(main())
