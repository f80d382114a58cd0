"""Engine step records of two parrot shared_prompt runs of P tokens and N users (engine
prefix cache off), from the root of the tree under test:

    cd TREE && PYTHONPATH=TREE python steplog.py P N
"""

import asyncio
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(os.getcwd()) / "benchmarks"))

import httpx  # noqa: E402
from appbench import modes, workloads  # noqa: E402
from apps import free_port, start_server, stop_server  # noqa: E402


async def main(p: int, n: int) -> None:
    port = free_port()
    proc = start_server(port, False, None, Path("/tmp/ab/steplog.log"), [])
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=url, timeout=900, trust_env=False) as http:
            warm = workloads.shared_prompt(1, users=2, prompt=128, gen=4, ignore_eos=True)
            await modes.run_parrot(http, warm, 0.0)
            for seed in (5, 6):
                wl = workloads.shared_prompt(seed, users=n, prompt=p, gen=8, ignore_eos=True)
                mark = await modes.step_mark(http)
                run = await modes.run_parrot(http, wl, 0.0)
                got = await http.get("/bench/steps", params={"after": mark})
                print("jct", round(run["jct"], 3))
                for s in got.json()["steps"]:
                    print({k: round(v, 3) if isinstance(v, float) else v for k, v in s.items()})
    finally:
        stop_server(proc)


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2])))
