"""One round of the join A/B (run from the root of the tree under test, with PYTHONPATH
set to it): start that tree's server (engine prefix cache off), run parrot shared_prompt
for each (P, N), print one JSON line each: JCT, engine steps, busy time, prefill tokens.

    cd TREE && PYTHONPATH=TREE python drive.py LABEL ROUND >> results.jsonl
"""

import asyncio
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(os.getcwd()) / "benchmarks"))

import httpx  # noqa: E402
from appbench import modes, workloads  # noqa: E402
from apps import free_port, start_server, stop_server  # noqa: E402

CONFIGS = [(256, 1), (256, 4), (256, 16), (1024, 1), (1024, 4), (1024, 16)]


async def main(label: str, rnd: int) -> None:
    port = free_port()
    proc = start_server(port, False, None, Path(f"/tmp/ab/{label}-{rnd}.log"), [])
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=url, timeout=900, trust_env=False) as http:
            warm = workloads.shared_prompt(1, users=2, prompt=128, gen=4, ignore_eos=True)
            await modes.run_parrot(http, warm, 0.0)
            for p, n in CONFIGS:
                seed = 90_000 + 100 * p + 10 * n + 100_000 * rnd
                wl = workloads.shared_prompt(seed, users=n, prompt=p, gen=8, ignore_eos=True)
                mark = await modes.step_mark(http)
                run = await modes.run_parrot(http, wl, 0.0)
                st = await modes.step_summary(http, mark)
                row = {
                    "tree": label,
                    "round": rnd,
                    "P": p,
                    "N": n,
                    "jct": run["jct"],
                    "steps": st.get("steps"),
                    "busy": st.get("busy_s"),
                    "prefill_s": st.get("prefill_s"),
                    "prefill_steps": st.get("prefill_steps"),
                    "prefill_tokens": st.get("prefill_tokens"),
                    "computed": run["engine"].get("prefill_computed"),
                }
                print(json.dumps(row), flush=True)
    finally:
        stop_server(proc)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
