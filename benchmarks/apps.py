"""The paper's applications, parrot vs request-level (and `transformers`), on one server.

    .venv/bin/python benchmarks/apps.py                 # CPU sizes, both cache settings
    .venv/bin/python benchmarks/apps.py --quick         # seconds: tiny sizes, 1 repetition
    .venv/bin/python benchmarks/apps.py --gpu --model DIR   # the paper's sizes (a GPU engine)
    .venv/bin/python benchmarks/apps.py --url http://127.0.0.1:8000   # a running server

For each engine prefix-cache setting (`on`, then `off`) the harness starts
`benchmarks/appbench/serve.py` (the real `parrot-backend serve` plus counters), measures
the engine's own prefill rate and decode step time (for the lower bound), then runs every
workload in both modes, alternating parrot / request-level `--reps` times, each run with
texts of its own (no run can hit another's cache). Modes:

- `parrot`: the whole program in one `POST /v1/runs`, every awaited output `latency`;
- `request-level`: each call to `/v1/completions` (streamed) when its inputs are back at
  the client, independent calls concurrently, as a LangChain app issues them;
- `transformers`: no server; `generate()` in this process on the same model folder, one
  batched call per wave of ready calls (`appbench/hf_mode.py`). It runs between the other
  two, `--hf-reps` times (default 1, 0: off) per workload, in one cache phase only (`on`,
  or the only one run), never in `mixed_tenant`; no round trip is paid (in process).

A simulated client round trip (`--rtt`, default 0.25 s) is paid once per program and once
per request. Results go to `--out` (default `benchmarks/results/apps`): `results.json`,
`table.md` (the table and the goals of issue 16) and `jct.png`, `prefill.png`; the
servers' logs go to the temp folder (`appbench-server-*.log`).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))

from appbench import hf_mode, modes, report, texts, workloads  # noqa: E402

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_taken(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is not taken
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def start_server(
    port: int, cache: bool, model: str | None, log: Path, extra: list[str]
) -> subprocess.Popen:
    """Start `appbench/serve.py` on `port` and wait for it. Refuses a port something else
    listens on: the harness must never measure (or load) another process's server."""
    if _port_taken(port):
        raise RuntimeError(f"port {port} is in use: pick another with --port")
    data = tempfile.mkdtemp(prefix="appbench-")
    cmd = [
        sys.executable,
        str(HERE / "appbench" / "serve.py"),
        "--port",
        str(port),
        "--data-dir",
        data,
        *([] if cache else ["--no-prefix-cache"]),
        *(["--model", model] if model else []),
        *extra,
    ]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}); see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                time.sleep(0.5)
                if proc.poll() is not None:  # it answered, but it was not ours
                    raise RuntimeError(f"server exited ({proc.returncode}); see {log}")
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError(f"server did not start in 600 s; see {log}")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _slim(run: dict) -> dict:
    calls = [
        {k: (v[:200] if k == "output" else v) for k, v in c.items() if k != "prompt"}
        for c in run["calls"]
    ]
    return {**{k: v for k, v in run.items() if k != "calls"}, "calls": calls}


async def run_phase(url: str, phase: str, args, tok, bar) -> list[dict]:
    records = []
    async with httpx.AsyncClient(
        base_url=url, timeout=600, trust_env=False, limits=httpx.Limits(max_connections=256)
    ) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        bar.set_description(f"{phase}: calibrating")
        cal_tokens = 160 if args.quick else 4000 if args.gpu else 1000
        cal = await modes.calibrate(
            http, model, texts.document(99_999, cal_tokens), reps=2 if args.quick else 3
        )
        r = await http.get("/bench/manager")
        cal["latency_capacity"] = (r.json() or {}).get("latency_capacity") if r.is_success else None
        for name in args.workloads:
            if name == "mixed_tenant":
                if phase != "off":  # once, with the engine's cache as deployed
                    records += await run_mixed(http, phase, args, model, bar)
                continue
            hf_reps = args.hf_reps if phase == args.hf_phase else 0
            for rep in range(max(args.reps, hf_reps)):
                for mi, mode in run_order(rep, args.reps, hf_reps):
                    seed = (
                        args.seed
                        + 1000 * (1 + list(workloads.BUILDERS).index(name))
                        + 10 * rep
                        + mi
                        + (500 if phase == "off" else 0)
                    )
                    wl = workloads.build(
                        name, seed, quick=args.quick, gpu=args.gpu, **args.sizes.get(name, {})
                    )
                    bar.set_description(f"cache {phase}: {name} {mode} #{rep + 1}")
                    if mode == "transformers":
                        if args.hf is None:
                            bar.set_description(f"cache {phase}: loading transformers model")
                            args.hf = await asyncio.to_thread(hf_mode.load, args.model)
                            bar.set_description(f"cache {phase}: {name} {mode} #{rep + 1}")
                        run = await hf_mode.run_transformers(wl, args.model, args.rtt, args.hf)
                        run["steps"] = {}  # the server's engine takes no part
                    else:
                        mark = await modes.step_mark(http)
                        if mode == "parrot":
                            run = await modes.run_parrot(http, wl, args.rtt)
                        else:
                            run = await modes.run_request_level(http, wl, args.rtt, model)
                        run["steps"] = await modes.step_summary(http, mark)
                    summary = report.summarise_run(wl, run, tok)
                    records.append(
                        {
                            "phase": phase,
                            "workload": name,
                            "mode": mode,
                            "rep": rep,
                            "seed": seed,
                            "info": wl.info,
                            # the server's engine speed: not the transformers mode's
                            "calibration": cal if mode != "transformers" else None,
                            "summary": summary,
                            "run": _slim(run),
                        }
                    )
                    bar.set_postfix_str(f"{mode} {summary['jct']:.1f}s")
                    bar.update(1)
    return records


async def run_mixed(http, phase: str, args, model: str, bar) -> list[dict]:
    """The latency chain alone, the batch alone, then both, in each mode; `--reps` times,
    which mode goes first alternating (single runs of this workload vary by +-20% on a
    shared machine: the report takes medians)."""
    out = []
    for rep in range(args.reps):
        for mode in workloads_order(rep):
            out.append(await _mixed_once(http, phase, args, model, bar, rep, mode))
    return out


async def _mixed_once(http, phase: str, args, model: str, bar, rep: int, mode: str) -> dict:
    mi = MODES_ORDER.index(mode)
    seed = args.seed + 9000 + 10 * mi + 100 * rep
    size = copy.deepcopy(MIXED["quick" if args.quick else "gpu" if args.gpu else "cpu"])
    for key, value in args.sizes.get("mixed_tenant", {}).items():
        part, _, name = key.partition(".")
        size[part][name] = value  # --size mixed_tenant.batch.docs=24

    def build(s: int, size: dict = size) -> tuple[workloads.Workload, workloads.Workload]:
        chain = workloads.build("chain_summary", s, quick=args.quick, **size["chain"])
        batch = workloads.build("map_reduce", s + 1, quick=args.quick, **size["batch"])
        batch.criterion = "throughput"
        return chain, batch

    chain, batch = build(seed)
    bar.set_description(f"cache {phase}: mixed_tenant {mode} #{rep + 1}")
    got = await modes.run_mixed(
        http,
        mode,
        chain,
        batch,
        args.rtt,
        model,
        delay=size["delay"],
        loaded=build(seed + 5),  # texts of their own: nothing cached by the alone runs
    )
    bar.set_postfix_str(f"{mode} chain {got['chain_loaded']:.1f}s loaded")
    bar.update(1)
    return {
        "phase": phase,
        "workload": "mixed_tenant",
        "mode": mode,
        "rep": rep,
        "seed": seed,
        "info": {"chain": chain.info, "batch": batch.info},
        "mixed": got,
    }


# mixed tenants: a latency chain submitted while a throughput map-reduce runs; on the CPU
# the batch takes ~11-14 s alone (36 documents; 12 ended before the chain once the engine
# ran on oneDNN's linear) and the chain ~2-3 s
MIXED = {
    "cpu": {
        "chain": {"parts": 3, "part": 96, "gen": 16},
        "batch": {"docs": 36, "doc": 128, "gen": 24, "reduce": 24},
        "delay": 2.0,
    },
    "gpu": {
        "chain": {"parts": 4, "part": 1024, "gen": 64},
        "batch": {"docs": 64, "doc": 1024, "gen": 64, "reduce": 64},
        "delay": 3.0,
    },
    "quick": {
        "chain": {"parts": 2, "part": 32, "gen": 4},
        "batch": {"docs": 4, "doc": 32, "gen": 4, "reduce": 4},
        "delay": 0.2,
    },
}
WORKLOADS = [*workloads.BUILDERS, "mixed_tenant"]


MODES_ORDER = ("parrot", "request-level")


def workloads_order(rep: int) -> tuple[str, str]:
    """Alternate which mode goes first, so drift on a shared machine hits both."""
    return ("parrot", "request-level") if rep % 2 == 0 else ("request-level", "parrot")


HF_SEED_OFFSET = 5  # the transformers runs' texts: a seed no other mode's run uses


def run_order(rep: int, reps: int, hf_reps: int) -> list[tuple[int, str]]:
    """(seed offset, mode) of repetition `rep`: parrot and request-level while rep < reps
    (their order alternating, their seeds as before), `transformers` between them while
    rep < hf_reps."""
    order = list(enumerate(workloads_order(rep))) if rep < reps else []
    if rep < hf_reps:
        order.insert(min(1, len(order)), (HF_SEED_OFFSET, "transformers"))
    return order


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    size_group = ap.add_mutually_exclusive_group()
    size_group.add_argument("--quick", action="store_true", help="tiny sizes, 1 repetition (CI)")
    size_group.add_argument(
        "--gpu",
        action="store_true",
        help="the paper's sizes (appbench/workloads.py GPU_SIZES), for a GPU engine",
    )
    ap.add_argument(
        "--model", help="model for the servers the harness starts (default SmolLM2-135M-Instruct)"
    )
    ap.add_argument("--url", help="use this running server instead (one phase, its cache)")
    ap.add_argument("--workloads", nargs="+", default=WORKLOADS, choices=WORKLOADS)
    ap.add_argument(
        "--cache",
        nargs="+",
        default=["on", "off"],
        choices=["on", "off"],
        help="engine prefix-cache settings to run (one server each)",
    )
    ap.add_argument("--reps", type=int, help="repetitions per mode (default 2; --quick 1)")
    ap.add_argument(
        "--hf-reps",
        type=int,
        default=1,
        help="repetitions of the transformers generate() mode per workload, in one cache "
        "phase (on, or the only one); 0 disables it (default 1, --quick too)",
    )
    ap.add_argument("--rtt", type=float, default=0.25, help="simulated client round trip, s")
    ap.add_argument("--port", type=int, help="port for the servers (default: a free one)")
    ap.add_argument(
        "--size",
        action="append",
        default=[],
        metavar="WORKLOAD.KEY=N",
        help="override a size, e.g. shared_prompt.users=12 (repeatable; keys in "
        "appbench/workloads.py SIZES; mixed_tenant.chain.KEY / mixed_tenant.batch.KEY "
        "for the mixed-tenant chain and batch, keys in apps.py MIXED)",
    )
    ap.add_argument(
        "--seed",
        type=int,
        help="base seed of the texts (default 0; with --url "
        "the clock, so a reused server's caches hold none of them)",
    )
    ap.add_argument("--out", type=Path, default=HERE / "results" / "apps")
    ap.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra argument for the servers (repeatable), e.g. "
        "--server-arg=--latency-capacity --server-arg=64",
    )
    args = ap.parse_args(argv)
    args.reps = args.reps or (1 if args.quick else 2)
    args.port = args.port or free_port()
    args.sizes = {}
    for item in args.size:
        key, _, value = item.partition("=")
        workload, _, field = key.partition(".")
        if workload == "mixed_tenant":
            part, _, name = field.partition(".")
            if part not in ("chain", "batch") or name not in MIXED["cpu"][part]:
                ap.error(f"--size {item}: no such size (mixed_tenant.chain.* / .batch.*)")
        elif workload not in workloads.SIZES or field not in workloads.SIZES[workload][0]:
            ap.error(f"--size {item}: no such workload size")
        args.sizes.setdefault(workload, {})[field] = int(value)
    if args.seed is None:
        args.seed = int(time.time()) * 10_000 if args.url else 0
    command = "python benchmarks/apps.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    tok = report.load_tokenizer(args.model)
    phases = ["external"] if args.url else args.cache
    if args.hf_reps < 0:
        ap.error("--hf-reps must be 0 or more")
    args.hf_phase = "on" if "on" in phases else phases[0]
    args.hf = None  # the transformers model, loaded at its first run and kept
    apps = [w for w in args.workloads if w != "mixed_tenant"]
    total = len(phases) * len(apps) * args.reps * 2 + len(apps) * args.hf_reps
    if "mixed_tenant" in args.workloads:
        total += 2 * args.reps * sum(p != "off" for p in phases)
    records: list[dict] = []
    args.out.mkdir(parents=True, exist_ok=True)
    began = time.time()
    with tqdm(total=total, unit="run", file=sys.stderr) as bar:
        for phase in phases:
            if args.url:
                records += asyncio.run(run_phase(args.url, phase, args, tok, bar))
                continue
            bar.set_description(f"cache {phase}: starting server")
            proc = start_server(
                args.port,
                phase == "on",
                args.model,
                Path(tempfile.gettempdir()) / f"appbench-server-cache-{phase}-{args.port}.log",
                args.server_arg,
            )
            try:
                records += asyncio.run(
                    run_phase(f"http://127.0.0.1:{args.port}", phase, args, tok, bar)
                )
            finally:
                stop_server(proc)
    meta = {
        "command": command,
        "rtt": args.rtt,
        "reps": args.reps,
        "hf_reps": args.hf_reps if apps else 0,
        "hf_phase": args.hf_phase if args.hf_reps and apps else None,
        "hf": (
            {"model_dir": str(args.hf.model_dir), "threads": args.hf.threads}
            if args.hf is not None
            else None
        ),
        "quick": args.quick,
        "gpu": args.gpu,
        "model": args.model or "SmolLM2-135M-Instruct",
        "seconds": time.time() - began,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    result = report.write(args.out, meta, records)
    print(result["table"])
    print(
        f"written to {args.out}: results.json, table.md"
        + "".join(f", {p}" for p in result["plots"])
        + f" ({meta['seconds']:.0f} s)"
    )
    return result


if __name__ == "__main__":
    main()
