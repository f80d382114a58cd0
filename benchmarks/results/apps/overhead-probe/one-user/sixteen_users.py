"""16 users on a 256-token shared prompt, parrot only: when each engine request is
submitted against the first engine steps (does every fork join the prefix fill's step?).
Starts `traced_serve.py` with the engine's `_submit` traced too (engine prefix cache off).

    .venv/bin/python benchmarks/results/apps/overhead-probe/one-user/sixteen_users.py

(Environment: P, N, R for prompt tokens, users and rounds; defaults 256, 16, 4.)
"""

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[3]))
import httpx  # noqa: E402
from appbench import modes, workloads  # noqa: E402
from apps import free_port  # noqa: E402

TRACE = Path(tempfile.mkdtemp(prefix="sixteen-")) / "trace.jsonl"
P = int(os.environ.get("P", 256))
N = int(os.environ.get("N", 16))


async def main():
    port = free_port()
    env = {**os.environ, "TRACE_FILE": TRACE, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(
        [
            sys.executable,
            str(HERE / "traced_serve.py"),
            "--trace-submits",
            "--port",
            str(port),
            "--data-dir",
            tempfile.mkdtemp(),
            "--no-prefix-cache",
        ],
        stdout=(TRACE.parent / "server.log").open("w"),
        stderr=subprocess.STDOUT,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    out = []
    try:
        async with httpx.AsyncClient(base_url=url, timeout=900, trust_env=False) as http:
            warm = workloads.shared_prompt(1, users=2, prompt=128, gen=4, ignore_eos=True)
            await modes.run_parrot(http, warm, 0.0)
            for r in range(int(os.environ.get("R", 4))):
                wl = workloads.shared_prompt(5000 + r, users=N, prompt=P, gen=8, ignore_eos=True)
                mark = await modes.step_mark(http)
                t0 = time.perf_counter()
                run = await modes.run_parrot(http, wl, 0.0, counters=False)
                t1 = time.perf_counter()
                await asyncio.sleep(0.3)
                steps = (await http.get("/bench/steps", params={"after": mark})).json()["steps"]
                out.append({"t0": t0, "t1": t1, "jct": run["jct"], "steps": steps})
    finally:
        proc.terminate()
        proc.wait()
    lines = [json.loads(line) for line in TRACE.read_text().splitlines()]
    for r in out:
        t0 = r["t0"]
        subs = [e for e in lines if e["n"] == "submit" and t0 <= e["t0"] <= r["t1"]]
        st = r["steps"]
        print(
            f"jct {r['jct']:.3f} steps {len(st)}: "
            + " | ".join(f"{s['seqs']}r/{s['tokens']}t@{(s['t'] - t0) * 1000:.0f}" for s in st[:4])
        )
        print(
            "   submits (ms, kind):",
            " ".join(f"{(e['t0'] - t0) * 1000:.1f}{e['kind'][0]}" for e in subs[:40]),
        )
        ev = [e for e in lines if t0 <= e["t0"] <= r["t1"] and e["n"] in ("dispatch.render",)]
        print(
            "   render:",
            [(round((e["t0"] - t0) * 1000, 1), round((e["t1"] - e["t0"]) * 1000, 1)) for e in ev],
        )


asyncio.run(main())
