"""Parrot's manager over llama.cpp vs the same calls sent to llama.cpp directly.

One llama.cpp `llama-server` (SmolLM2-135M Q4_1, `--parallel 4`, 2 threads) serves every
arm; each round runs each arm once, in a rotating order, so load from other work on the
shared CPU falls on all arms alike:

- **direct**: a request-level client, as a LangChain app with langchain-openai's `OpenAI`
  LLM sends them: the openai SDK's `completions.create` with rendered text prompts against
  llama.cpp's `/v1/completions`, concurrent where the application is (`batch`, the maps),
  one round trip per dependent step (the reduce after the maps).
- **parrot**: `parrot-backend serve --no-local-engine --upstream <llama.cpp>/v1` runs the
  same calls as native programs (one request per run, then long-polls for the values):
  prefix-affinity placement, shared prefixes warmed once, no client round trip between
  the maps and the reduce.
- **parrot-nowarm**: the same with `--upstream-no-warm`.

Workloads (greedy; every round's texts start with a fresh tag, so no arm reuses another
arm's or an earlier round's cache):

- **shared system prompt**: `--requests` independent one-call runs (users) with one long
  system prompt and their own question each, all submitted at once;
- **map-reduce**: `--maps` calls summarizing one passage each under one long instruction,
  then one call combining the summaries.

Per arm and round: the wall time from the first request to the last value, and llama.cpp's
own counts of prompt tokens it evaluated and reused from its cache (`/metrics` deltas: the
arms never overlap). Medians over rounds; ratios direct / parrot (> 1: parrot faster).

    .venv/bin/python benchmarks/upstream_bench.py [--rounds 5] [--threads 1]
        [--prefix-repeat 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

from parrot_backend.testing.llama_server import LlamaServer, free_port, smollm2_gguf

SYSTEM = (
    "You are the support assistant of a bird sanctuary. Visitors ask about the parrots, "
    "macaws, cockatoos and parakeets that live here, about feeding times, the aviaries, the "
    "breeding programme and how to adopt a bird. Answer in one short sentence. Be friendly, "
    "precise and never invent facts: if you do not know, say so. Feeding is at nine and at "
    "four. The aviaries open at ten and close at six. Adoption needs a home visit first. "
)
QUESTIONS = [
    "When are the birds fed?",
    "Can I adopt a macaw?",
    "Do parrots talk?",
    "When do the aviaries open?",
    "Is there a cafe?",
    "How long do cockatoos live?",
    "Can children feed the birds?",
    "What do parakeets eat?",
    "Is photography allowed?",
    "How do I become a volunteer?",
    "Are dogs allowed?",
    "What is the breeding programme?",
]
INSTRUCTION = (
    "Summarize the passage below in one short sentence for a field guide. Keep names and "
    "numbers, drop opinions, write plain English without lists or headings. Passages come "
    "from visitor notes and may be informal; correct obvious spelling but keep the meaning. "
)
PASSAGES = [
    "The grey parrot in aviary 3 learned forty words this year and greets keepers by name.",
    "Two macaws hatched in May; both chicks are healthy and weigh about 400 grams each.",
    "A cockatoo escaped during cleaning but returned to its perch within an hour.",
    "The parakeet flock grew to sixty birds after the spring breeding season ended.",
    "Visitors reported that the amazon parrots sing along to the radio in the kitchen.",
    "A new fruit mix with papaya and mango reduced feather plucking in three birds.",
    "Keepers trained the kea to open puzzle boxes, which keeps it busy for hours.",
    "The lovebirds paired up quickly and built nests from shredded paper strips.",
]


# ------------------------------------------------------------------ the two clients
async def direct_shared(client: openai.AsyncOpenAI, tag: str, n: int, max_tokens: int) -> list[str]:
    prompts = [f"[{tag}] {SYSTEM}\nQuestion: {q}\nAnswer:" for q in QUESTIONS[:n]]
    answers = await asyncio.gather(
        *(
            client.completions.create(
                model="m", prompt=p, max_tokens=max_tokens, temperature=0, stop=["\n"]
            )
            for p in prompts
        )
    )
    return [a.choices[0].text for a in answers]


async def direct_map_reduce(
    client: openai.AsyncOpenAI, tag: str, n: int, max_tokens: int
) -> list[str]:
    maps = [f"[{tag}] {INSTRUCTION}\nPassage: {p}\nSummary:" for p in PASSAGES[:n]]
    answers = await asyncio.gather(
        *(
            client.completions.create(
                model="m", prompt=p, max_tokens=max_tokens, temperature=0, stop=["\n"]
            )
            for p in maps
        )
    )
    summaries = [a.choices[0].text for a in answers]
    joined = "\n".join(f"- {s}" for s in summaries)
    reduce = f"[{tag}] {INSTRUCTION}\nSummaries:\n{joined}\nOne sentence for all:"
    final = await client.completions.create(
        model="m", prompt=reduce, max_tokens=max_tokens, temperature=0, stop=["\n"]
    )
    return [*summaries, final.choices[0].text]


def _call(name: str, template: str, out: str, max_tokens: int) -> dict:
    return {
        "name": name,
        "template": template,
        "outputs": {out: {"max_tokens": max_tokens, "stop": ["\n"]}},
    }


def _brace(text: str) -> str:
    return text.replace("{{", "\\{{")


async def parrot_shared(client: httpx.AsyncClient, tag: str, n: int, max_tokens: int) -> list[str]:
    async def one(q: str) -> str:
        template = _brace(f"[{tag}] {SYSTEM}\nQuestion: ") + "{{input:q}}\nAnswer:{{output:a}}"
        run = await client.post(
            "/v1/runs",
            json={
                "program": {"calls": [_call("answer", template, "a", max_tokens)]},
                "inputs": {"q": q},
                "outputs": {"a": "latency"},
            },
        )
        run.raise_for_status()
        return await _value(client, run.json()["run_id"], "a")

    return list(await asyncio.gather(*(one(q) for q in QUESTIONS[:n])))


async def parrot_map_reduce(
    client: httpx.AsyncClient, tag: str, n: int, max_tokens: int
) -> list[str]:
    head = _brace(f"[{tag}] {INSTRUCTION}\n")
    calls = [
        _call(
            f"map{i}",
            head + f"Passage: {{{{input:p{i}}}}}\nSummary:{{{{output:s{i}}}}}",
            f"s{i}",
            max_tokens,
        )
        for i in range(n)
    ]
    joined = "\n".join(f"- {{{{input:s{i}}}}}" for i in range(n))
    calls.append(
        _call(
            "reduce",
            head + f"Summaries:\n{joined}\nOne sentence for all:{{{{output:total}}}}",
            "total",
            max_tokens,
        )
    )
    run = await client.post(
        "/v1/runs",
        json={
            "program": {"calls": calls},
            "inputs": {f"p{i}": PASSAGES[i] for i in range(n)},
            "outputs": {"total": "latency"},
        },
    )
    run.raise_for_status()
    run_id = run.json()["run_id"]
    total = await _value(client, run_id, "total")
    return [*[await _value(client, run_id, f"s{i}") for i in range(n)], total]


async def _value(client: httpx.AsyncClient, run_id: str, name: str) -> str:
    while True:
        got = await client.get(f"/v1/runs/{run_id}/variables/{name}", params={"timeout": 120})
        if got.status_code == 408:
            continue
        got.raise_for_status()
        body = got.json()
        if body.get("status") == "failed":
            raise RuntimeError(f"{name} failed: {body}")
        return body["value"]


# ------------------------------------------------------------------ processes
class Serve:
    """`parrot-backend serve --no-local-engine --upstream URL` on a free port."""

    def __init__(self, upstream: str, logs: Path, name: str, extra: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = logs / f"{name}.log"
        self.cmd = [
            str(Path(sys.executable).with_name("parrot-backend")),
            "serve",
            "--no-local-engine",
            "--upstream",
            upstream,
            "--port",
            str(self.port),
            "--data-dir",
            tempfile.mkdtemp(prefix=f"upstream-bench-{name}-"),
            *extra,
        ]

    def __enter__(self) -> Serve:
        self._log = open(self.log_path, "w")  # closed in __exit__
        self.process = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"serve exited; see {self.log_path}")
            try:
                if httpx.get(self.url + "/healthz", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"serve not healthy; see {self.log_path}")

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self._log.close()


def llama_counts(url: str) -> dict[str, float]:
    counts = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        for name in ("prompt_tokens_total", "prompt_tokens_cached_total", "tokens_predicted_total"):
            if line.startswith(f"llamacpp:{name} "):
                counts[name] = float(line.split()[1])
    return counts


def wait_idle(url: str) -> None:
    for _ in range(600):
        if not any(s["is_processing"] for s in httpx.get(url + "/slots", timeout=30).json()):
            return
        time.sleep(0.1)


# ------------------------------------------------------------------ measuring
async def measure(args: argparse.Namespace, llama: str, serves: dict[str, str]) -> dict:
    oai = openai.AsyncOpenAI(base_url=llama + "/v1", api_key="none", max_retries=0, timeout=600)
    clients = {name: httpx.AsyncClient(base_url=url, timeout=600) for name, url in serves.items()}
    arms = ["direct", *serves]
    workloads = {
        "shared system prompt": (args.requests, direct_shared, parrot_shared),
        "map-reduce": (args.maps, direct_map_reduce, parrot_map_reduce),
    }
    samples: dict = {
        w: {a: {"s": [], "evaluated": [], "cached": []} for a in arms} for w in workloads
    }
    outputs: dict = {w: {} for w in workloads}
    for rnd in range(-1, args.rounds):  # round -1 warms every path up and is not counted
        order = arms[rnd % len(arms) :] + arms[: rnd % len(arms)]
        for workload, (n, direct, parrot) in workloads.items():
            for arm in order:
                tag = f"{workload[:3]}-r{rnd}-{arm}"
                wait_idle(llama)
                before = llama_counts(llama)
                began = time.perf_counter()
                if arm == "direct":
                    values = await direct(oai, tag, n, args.max_tokens)
                else:
                    values = await parrot(clients[arm], tag, n, args.max_tokens)
                took = time.perf_counter() - began
                wait_idle(llama)
                after = llama_counts(llama)
                if rnd < 0:
                    continue
                s = samples[workload][arm]
                s["s"].append(took)
                s["evaluated"].append(after["prompt_tokens_total"] - before["prompt_tokens_total"])
                s["cached"].append(
                    after["prompt_tokens_cached_total"] - before["prompt_tokens_cached_total"]
                )
                outputs[workload].setdefault(rnd, {})[arm] = values
                print(
                    f"round {rnd} {workload:20s} {arm:14s} {took:6.2f} s, prompt tokens "
                    f"evaluated {s['evaluated'][-1]:.0f}, reused {s['cached'][-1]:.0f}",
                    flush=True,
                )
    for client in clients.values():
        await client.aclose()
    medians = {
        w: {a: {k: statistics.median(v) for k, v in s.items()} for a, s in arms_.items()}
        for w, arms_ in samples.items()
    }
    return {"samples": samples, "medians": medians, "outputs": outputs}


def table(result: dict) -> str:
    lines = []
    for workload, arms in result["medians"].items():
        base = arms["direct"]["s"]
        lines += [
            f"\n{workload}:",
            "",
            "| arm | wall time (median) | direct / arm | prompt tokens evaluated | "
            "reused from llama.cpp's cache |",
            "| --- | --- | --- | --- | --- |",
        ]
        for arm, m in arms.items():
            lines.append(
                f"| {arm} | {m['s']:.2f} s | {base / m['s']:.2f}x | "
                f"{m['evaluated']:.0f} | {m['cached']:.0f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--maps", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument(
        "--prefix-repeat",
        type=int,
        default=1,
        help="repeat the system prompt and the map instruction N times (longer shared prefixes)",
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    global SYSTEM, INSTRUCTION  # the clients read them at call time
    SYSTEM, INSTRUCTION = SYSTEM * args.prefix_repeat, INSTRUCTION * args.prefix_repeat
    logs = Path(tempfile.mkdtemp(prefix="upstream-bench-"))
    llama = LlamaServer(
        None,
        smollm2_gguf(),
        ctx_size=2048 * args.parallel,
        parallel=args.parallel,
        threads=args.threads,
        log_path=logs / "llama-server.log",
    )
    with llama:
        up = llama.url + "/v1"
        with (
            Serve(up, logs, "parrot", []) as warm,
            Serve(up, logs, "parrot-nowarm", ["--upstream-no-warm"]) as cold,
        ):
            result = asyncio.run(
                measure(args, llama.url, {"parrot": warm.url, "parrot-nowarm": cold.url})
            )
        build = httpx.get(llama.url + "/props").json().get("build_info")
    result["config"] = {k: v for k, v in vars(args).items() if k != "json"}
    result["config"] |= {"llama_build": build, "cpus": os.cpu_count(), "logs": str(logs)}
    print(table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
