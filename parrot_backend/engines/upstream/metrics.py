"""What an upstream's Prometheus `/metrics` says about its load, read the same for each kind.

Only gauges and counters the scheduler can use are read: requests running and waiting,
KV cache usage, KV capacity, and prefix-cache counters. Names checked against each
server's documentation (llama.cpp against the real server in tests/upstream):

- llama.cpp (`--metrics`): `llamacpp:requests_processing`, `llamacpp:requests_deferred`,
  `llamacpp:prompt_tokens_total`, `llamacpp:tokens_predicted_total`.
- vLLM: `vllm:num_requests_running`, `vllm:num_requests_waiting`,
  `vllm:kv_cache_usage_perc` (`vllm:gpu_cache_usage_perc` before V1),
  `vllm:prefix_cache_queries_total` / `vllm:prefix_cache_hits_total`, and the KV size from
  `vllm:cache_config_info`'s `num_gpu_blocks` and `block_size` labels.
- SGLang (`--enable-metrics`): `sglang:num_running_reqs`, `sglang:num_queue_reqs`,
  `sglang:token_usage`, `sglang:max_total_num_tokens`.
- parrot-backend's own server: `parrot_engine_running`, `parrot_engine_queue_depth`,
  `parrot_kv_blocks_total` / `parrot_kv_blocks_used`.

Series with several label sets (one per model or rank) are summed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(slots=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def parse(text: str) -> list[Sample]:
    """The samples of a Prometheus text exposition (comments and malformed lines skipped)."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if m is None:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        labels = dict(_LABEL.findall(m.group(2) or ""))
        out.append(Sample(m.group(1), labels, value))
    return out


@dataclass(slots=True)
class Load:
    """An upstream's load as its metrics tell it; None where they do not say."""

    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None  # fraction of the KV cache in use, 0..1
    kv_tokens: int | None = None  # KV capacity in tokens
    prefix_hits: int | None = None  # tokens served from its prefix cache
    prefix_queries: int | None = None
    prompt_tokens: int | None = None
    generated_tokens: int | None = None


def _sum(samples: list[Sample], *names: str) -> float | None:
    for name in names:
        values = [s.value for s in samples if s.name == name]
        if values:
            return sum(values)
    return None


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)


def read_load(text: str) -> Load:
    """The load of whichever kind of server wrote `text`."""
    s = parse(text)
    load = Load(
        running=_int(
            _sum(
                s,
                "llamacpp:requests_processing",
                "vllm:num_requests_running",
                "sglang:num_running_reqs",
                "parrot_engine_running",
            )
        ),
        waiting=_int(
            _sum(
                s,
                "llamacpp:requests_deferred",
                "vllm:num_requests_waiting",
                "sglang:num_queue_reqs",
                "parrot_engine_queue_depth",
            )
        ),
        kv_usage=_sum(
            s,
            "vllm:kv_cache_usage_perc",
            "vllm:gpu_cache_usage_perc",
            "sglang:token_usage",
            "parrot_kv_usage_ratio",
        ),
        kv_tokens=_int(_sum(s, "sglang:max_total_num_tokens")),
        prefix_hits=_int(
            _sum(
                s,
                "vllm:prefix_cache_hits_total",
                "vllm:prefix_cache_hits",
                "parrot_prefix_cache_hit_tokens_total",
            )
        ),
        prefix_queries=_int(
            _sum(
                s,
                "vllm:prefix_cache_queries_total",
                "vllm:prefix_cache_queries",
                "parrot_prefix_cache_query_tokens_total",
            )
        ),
        prompt_tokens=_int(
            _sum(
                s,
                "llamacpp:prompt_tokens_total",
                "vllm:prompt_tokens_total",
                "sglang:prompt_tokens_total",
            )
        ),
        generated_tokens=_int(
            _sum(
                s,
                "llamacpp:tokens_predicted_total",
                "vllm:generation_tokens_total",
                "sglang:generation_tokens_total",
            )
        ),
    )
    for sample in s:
        if sample.name == "vllm:cache_config_info" and load.kv_tokens is None:
            try:
                blocks = int(sample.labels["num_gpu_blocks"])
                size = int(sample.labels["block_size"])
            except (KeyError, ValueError):
                continue
            load.kv_tokens = blocks * size
    total = _sum(s, "parrot_kv_blocks_total")
    used = _sum(s, "parrot_kv_blocks_used")
    if total and used is not None and load.kv_usage is None:
        load.kv_usage = used / total
    return load
