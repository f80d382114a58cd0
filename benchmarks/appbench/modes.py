"""Running one workload once: whole program (`parrot`) or call by call (`request-level`).

Both modes talk HTTP to one `serve` process and record the same things: JCT (client's
start to the last awaited value, round trips included), per-call TTFT (first token minus
the moment the call's inputs existed on the side that sends it), per-call latency per
generated token, tokens generated, the prompts as rendered (for prefill accounting) and
the engine's counters before and after (`/bench/engine`, see `serve.py`).

The simulated client round trip `rtt` is paid half on the way in and half on the way out
of every request the client waits on: once per program in parrot mode, once per call in
request-level mode (a LangChain app sends each dependent call after its inputs return).
"""

from __future__ import annotations

import asyncio
import json
import time
from datetime import datetime

import httpx

from .workloads import Workload

# How long one request-level call may wait for its answer. The server starts a streamed
# completion once its prompt is prefilled, so a call queued behind a backlog gets no bytes
# until then: 64 concurrent users of a 4,096-token prompt are ~260,000 prefill tokens,
# ~10 minutes on the 2-core CPU, and the last of them timed out at 600 s.
REQUEST_TIMEOUT_S = 3600


def _at(stamp: str | None) -> float | None:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() if stamp else None


async def engine_counters(http: httpx.AsyncClient) -> dict:
    r = await http.get("/bench/engine")
    return r.json() if r.status_code == 200 else {}


def counter_delta(before: dict, after: dict, calls: int) -> dict:
    """Prefill tokens the engine computed in a window: every computed token that is not
    the KV of a sampled token (a call of G tokens computes its prompt plus G - 1 more)."""
    if not before or not after:
        return {}
    d = {
        k: after[k] - before[k]
        for k in (
            "tokens_computed",
            "tokens_generated",
            "prefix_cache_hits",
            "prefix_cache_queries",
            "steps",
            "preemptions",
        )
    }
    d["prefill_computed"] = d["tokens_computed"] - max(0, d["tokens_generated"] - calls)
    return d


async def step_mark(http: httpx.AsyncClient) -> int | None:
    """Index of the next engine step record (`/bench/steps`), None without the route."""
    r = await http.get("/bench/steps", params={"after": 2**62})
    return r.json()["next"] if r.status_code == 200 else None


async def forget(http: httpx.AsyncClient) -> bool:
    """Drop the server's cached prefixes (`/bench/forget`); False without the route."""
    r = await http.post("/bench/forget")
    return r.status_code == 200


async def step_summary(http: httpx.AsyncClient, mark: int | None) -> dict:
    """Where the engine's time went since `mark`: busy time in steps with prefill tokens
    and in pure decode steps, step counts, the mean decode batch."""
    if mark is None:
        return {}
    steps = (await http.get("/bench/steps", params={"after": mark})).json()["steps"]
    if not steps:
        return {}
    pre = [s for s in steps if s["prefill"] > 0]
    dec = [s for s in steps if s["prefill"] == 0]
    return {
        "steps": len(steps),
        "busy_s": sum(s["dt"] for s in steps),
        "prefill_steps": len(pre),
        "prefill_s": sum(s["dt"] for s in pre),
        "prefill_tokens": sum(s["prefill"] for s in pre),
        "decode_steps": len(dec),
        "decode_s": sum(s["dt"] for s in dec),
        "decode_batch_mean": (sum(s["decode"] for s in dec) / len(dec)) if dec else None,
        "decode_drafts": sum(s.get("drafts", 0) for s in dec),
        "span_s": steps[-1]["t"] + steps[-1]["dt"] - steps[0]["t"],
        "threads_min": min((s["threads"] for s in steps if s.get("threads")), default=None),
    }


async def _settle(http: httpx.AsyncClient) -> dict:
    """The engine's counters once it is idle (contexts freed after a run may still step)."""
    last = await engine_counters(http)
    for _ in range(50):
        if not last or (last.get("running", 0) == 0 and last.get("waiting", 0) == 0):
            return last
        await asyncio.sleep(0.05)
        last = await engine_counters(http)
    return last


async def run_parrot(
    http: httpx.AsyncClient, wl: Workload, rtt: float, counters: bool = True
) -> dict:
    """Submit the whole program; wait for every awaited output (long polls in parallel)."""
    before = await _settle(http) if counters else {}
    body = {
        "program": {"calls": [c.spec() for c in wl.calls]},
        "inputs": wl.inputs,
        "outputs": dict.fromkeys(wl.outputs, wl.criterion),
    }
    start = time.time()
    await asyncio.sleep(rtt / 2)
    r = await http.post("/v1/runs", json=body)
    r.raise_for_status()
    run_id = r.json()["run_id"]

    async def wait(name: str) -> None:
        while True:
            v = await http.get(
                f"/v1/runs/{run_id}/variables/{name}",
                params={"perf": wl.criterion, "timeout": 120},
                timeout=130,
            )
            if v.status_code == 408:
                continue
            v.raise_for_status()
            if v.json()["status"] != "ready":
                raise RuntimeError(f"{name}: {v.json().get('error')}")
            return

    await asyncio.gather(*(wait(o) for o in wl.outputs))
    await asyncio.sleep(rtt / 2)
    jct = time.time() - start
    for _ in range(100):  # call records are written just after their values
        detail = (await http.get(f"/v1/runs/{run_id}")).json()
        if all(c["finished_at"] for c in detail["calls"]):
            break
        await asyncio.sleep(0.05)
    after = await _settle(http) if counters else {}
    values = {k: v["value"] for k, v in detail["variables"].items()}
    ready = {k: _at(v["set_at"]) for k, v in detail["variables"].items()}
    created = _at(detail["run"]["created_at"])
    calls = []
    for spec, c in zip(wl.calls, detail["calls"], strict=True):
        avail = max([created] + [ready[i] for i in spec.inputs if i not in wl.inputs])
        first, done = _at(c["first_token_at"]), _at(c["finished_at"])
        calls.append(
            {
                "name": spec.name,
                "ready": avail - start,
                "ttft": first - avail,
                "latency": done - avail,
                "tokens": c["completion_tokens"] or 0,
                "prompt": spec.render(values),
                "output": values[spec.output],
                "start_offset": avail - start,
                "end": done - start,
            }
        )
    return {
        "jct": jct,
        "calls": calls,
        "engine": counter_delta(before, after, len(calls)),
        "run_id": run_id,
    }


async def run_request_level(
    http: httpx.AsyncClient, wl: Workload, rtt: float, model: str, counters: bool = True
) -> dict:
    """Each call to `/v1/completions` (streamed) once its inputs are back at the client,
    independent calls concurrently."""
    before = await _settle(http) if counters else {}
    loop = asyncio.get_running_loop()
    values: dict[str, asyncio.Future] = {}
    for name, value in wl.inputs.items():
        values[name] = loop.create_future()
        values[name].set_result(value)
    for c in wl.calls:
        values[c.output] = loop.create_future()
    start = time.time()
    records: dict[str, dict] = {}

    async def one(call) -> None:
        got = {i: await values[i] for i in call.inputs}
        avail = time.time()
        prompt = call.render(got)
        await asyncio.sleep(rtt / 2)
        sent = time.time()
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": call.max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if call.ignore_eos:
            body["ignore_eos"] = True
        text, first, usage = [], None, {}
        async with http.stream(
            "POST", "/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S
        ) as r:
            if r.status_code != 200:
                raise RuntimeError(f"{call.name}: {r.status_code} {(await r.aread())[:200]}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(f"{call.name}: {chunk['error']}")
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices", []):
                    if choice.get("text"):
                        first = first or time.time()
                        text.append(choice["text"])
        done = time.time()
        await asyncio.sleep(rtt / 2)
        records[call.name] = {
            "name": call.name,
            "ready": avail - start,
            "ttft": (first or done) - sent,
            "latency": done - sent,
            "tokens": usage.get("completion_tokens", 0),
            "prompt_tokens": usage.get("prompt_tokens"),
            "prompt": prompt,
            "output": "".join(text),
            "start_offset": sent - start,
            "end": done - start,
        }
        values[call.output].set_result("".join(text))

    await asyncio.gather(*(one(c) for c in wl.calls))
    await asyncio.gather(*(values[o] for o in wl.outputs))
    jct = time.time() - start
    after = await _settle(http) if counters else {}
    calls = [records[c.name] for c in wl.calls]
    return {"jct": jct, "calls": calls, "engine": counter_delta(before, after, len(calls))}


async def run_mixed(
    http: httpx.AsyncClient,
    mode: str,
    chain: Workload,
    batch: Workload,
    rtt: float,
    model: str,
    delay: float,
    loaded: tuple[Workload, Workload] | None = None,
) -> dict:
    """Mixed tenants, in one mode: the throughput batch alone, the batch with the chain
    submitted `delay` s after it, then the same chain alone (idle). The batch's outputs are
    `throughput` in parrot mode; request-level has no way to say so (FIFO). `loaded`: the
    (chain, batch) of the loaded run, the same shapes with texts of their own (default:
    the same workloads). On a server with `/bench/forget` every run starts with nothing
    cached, and the idle chain is the loaded one, run again (its JCT depends on what it
    generates, so a chain of other texts is no baseline: +-30% here); without the route
    the idle chain is `chain`, run first, on texts of its own."""

    async def one(wl: Workload) -> dict:
        if mode == "parrot":
            return await run_parrot(http, wl, rtt, counters=False)
        return await run_request_level(http, wl, rtt, model, counters=False)

    async def later(wl: Workload) -> dict:
        await asyncio.sleep(delay)
        return await one(wl)

    chain2, batch2 = loaded or (chain, batch)
    same = await forget(http)
    if not same:
        chain_idle = await one(chain)
    batch_alone = await one(batch)
    await forget(http)
    batch_loaded, chain_loaded = await asyncio.gather(one(batch2), later(chain2))
    if same:
        await forget(http)
        chain_idle = await one(chain2)

    def tput(run: dict) -> float:
        return sum(c["tokens"] for c in run["calls"]) / run["jct"]

    return {
        "chain_idle": chain_idle["jct"],
        "idle_same_texts": same,  # the idle chain is the loaded one, run again
        "chain_loaded": chain_loaded["jct"],
        "batch_alone_jct": batch_alone["jct"],
        "batch_loaded_jct": batch_loaded["jct"],
        "batch_alone_tput": tput(batch_alone),
        "batch_loaded_tput": tput(batch_loaded),
    }


async def calibrate(http: httpx.AsyncClient, model: str, prompt: str, reps: int = 2) -> dict:
    """The engine's own speed, alone: prefill tokens/s on a long unique prompt (one
    token generated) and the decode step time at batch 1 (streamed, 32 tokens). The
    stream is sampled (temperature 1, seeded), not greedy: a greedy row may check draft
    tokens and take several per step (`engine/speculate.py`), and how many depends on the
    text; the bound is for one token per step, so a greedy workload can go below it."""
    best_rate, best_step, n_prompt = 0.0, float("inf"), 0
    warm = {"model": model, "prompt": prompt[: len(prompt) // 2], "max_tokens": 4}
    await http.post("/v1/completions", json=warm, timeout=REQUEST_TIMEOUT_S)  # first-use costs
    for rep in range(reps):
        body = {
            "model": model,
            "prompt": f"[{rep}:{time.time()}] " + prompt,
            "max_tokens": 1,
            "temperature": 0,
        }
        t = time.perf_counter()
        r = await http.post("/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S)
        took = time.perf_counter() - t
        n_prompt = r.json()["usage"]["prompt_tokens"]
        best_rate = max(best_rate, n_prompt / took)
        body = {
            "model": model,
            "prompt": f"Count slowly ({rep}):",
            "max_tokens": 32,
            "temperature": 1.0,
            "seed": rep,
            "stream": True,
            "ignore_eos": True,
        }
        stamps = []
        async with http.stream(
            "POST", "/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S
        ) as s:
            async for line in s.aiter_lines():
                if line.startswith("data: {"):
                    stamps.append(time.perf_counter())
        if len(stamps) > 2:
            best_step = min(best_step, (stamps[-1] - stamps[0]) / (len(stamps) - 1))
    return {
        "prefill_tokens_per_s": best_rate,
        "decode_step_s": best_step,
        "calibration_prompt_tokens": n_prompt,
    }
