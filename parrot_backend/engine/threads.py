"""How many CPU threads the compute thread's torch ops use, chosen from measured steps.

torch parallelises each op over an OpenMP team as large as the machine. A server shares
its cores: when another process keeps one of them busy, every parallel region waits at
its barrier for the team's worker descheduled there, and decode ran 3-5x slower where
losing one core of two should cost about 2x. No fixed setting wins in both cases, so
`ThreadTuner` measures: first after a few steps, then every `probe_every_s`, it runs a
few steps with another thread count, alternating with the current count step by step,
and keeps whichever made the work cheaper (time per computed token, compared between
steps of the same size: a prefill chunk and a decode step cost very differently per
token). Alternating matters: against the steps *before* a probe, the first decode steps
after a long prefill (or a noisy spell of the host) made one thread look cheaper on a
quiet 2-core machine, where it then decoded at 56-66 ms a step instead of 34-37 ms until
the next probe. A probe that changes nothing doubles the interval to the next (up to
`max_probe_every_s`), so a steady machine pays little. A co-located load then costs about
its share of the cores, and the engine goes back to the whole team once the load is
gone.

Only small steps (at most `probe_max_tokens` tokens: decode steps, short prefills) run the
tried count. A probe falls due after any pause longer than the interval, so it used to
start on the first step of the next request, usually a prefill chunk: 512 tokens on one
thread of two took 0.9-1.0 s where the whole team takes ~0.5 s (SmolLM2, 2 cores), added to
that request's time to first token. A tried decode step costs tens of milliseconds.
Large steps during a probe run the current count, and they are not counted for it.

Everything here runs on the compute thread: OpenMP's thread count is a per-thread
setting, and `torch.set_num_threads` applies to the thread that calls it.
"""

from __future__ import annotations

import os
import statistics
import time
from collections import deque
from collections.abc import Callable


def available_cores() -> int:
    """Cores this process may run on (its affinity mask; the machine's count elsewhere)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class ThreadTuner:
    """Chooses the thread count of each step; `fixed` turns measurement off."""

    def __init__(
        self,
        max_threads: int,
        *,
        fixed: bool = False,
        probe_every_s: float = 5.0,
        max_probe_every_s: float = 40.0,
        probe_steps: int = 3,
        probe_max_tokens: int = 64,
        margin: float = 1.15,
        set_threads: Callable[[int], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.max_threads = max(1, max_threads)
        self.fixed = fixed
        self.current = self.max_threads
        self.probe_every_s = probe_every_s
        self.max_probe_every_s = max(max_probe_every_s, probe_every_s)
        self._interval = probe_every_s  # doubles after each probe that changes nothing
        self.probe_steps = probe_steps
        self.probe_max_tokens = probe_max_tokens
        self.margin = margin
        self.clock = clock
        self._set = set_threads or _torch_set_threads
        # what the compute thread runs with: one thread serves every engine of a process
        self._applied = _COMPUTE_THREAD if set_threads is None else {"threads": None}
        # cost per token of recent steps at `current`, by step size (a prefill chunk and
        # a decode step cost very differently per token: only like is compared with like)
        self._recent: dict[int, deque[float]] = {}
        self._probe: int | None = None  # the count being tried, if probing
        # while probing: cost per token by (thread count, step size), both counts
        # measured alternately in the same stretch of time
        self._probe_costs: dict[tuple[int, int], list[float]] = {}
        self._probe_turn = False  # the next step of a probe runs the tried count
        self._probe_left = 0  # steps the probe may still take before it is given up
        self._next_probe = clock()  # the first probe as soon as a few steps were measured
        self.switches = 0

    def candidates(self) -> list[int]:
        """Thread counts worth trying: the whole team, half of it, one."""
        return sorted({self.max_threads, max(1, self.max_threads // 2), 1}, reverse=True)

    def before_step(self, tokens: int | None = None) -> int:
        """Apply and return the thread count for the next step, of `tokens` tokens (None:
        unknown, treated as small)."""
        threads = self.current
        small = tokens is None or tokens <= self.probe_max_tokens
        if not self.fixed and small:
            if (
                self._probe is None
                and self.clock() >= self._next_probe
                and any(
                    len(q) == self.probe_steps
                    for size, q in self._recent.items()
                    if size <= self.probe_max_tokens.bit_length()
                )
            ):
                others = [n for n in self.candidates() if n != self.current]
                if others:
                    # try the neighbour: fewer threads from the whole team, more from fewer
                    self._probe = (
                        others[0]
                        if self.current == self.max_threads
                        else max(n for n in others if n > self.current)
                    )
                    self._probe_costs = {}
                    self._probe_turn = True
                    self._probe_left = 8 * self.probe_steps
            if self._probe is not None and self._probe_turn:
                threads = self._probe
        if threads != self._applied["threads"]:
            self._set(threads)
            self._applied["threads"] = threads
        return threads

    def after_step(self, threads: int, seconds: float, tokens: int) -> None:
        """Record a step's time for the `tokens` it computed."""
        if self.fixed or tokens <= 0:
            return
        cost = seconds / tokens
        size = tokens.bit_length()  # steps of 1, 2-3, 4-7, 8-15, ... tokens
        if self._probe is None:
            self._recent.setdefault(size, deque(maxlen=self.probe_steps)).append(cost)
            return
        if tokens > self.probe_max_tokens:
            return  # ran the current count outside the probe (see the module doc)
        self._probe_turn = threads != self._probe  # alternate: the other count next
        tried = self._probe_costs.setdefault((threads, size), [])
        tried.append(cost)
        self._probe_left -= 1
        probe = self._probe_costs.get((self._probe, size), [])
        kept = self._probe_costs.get((self.current, size), [])
        if len(probe) >= self.probe_steps and len(kept) >= self.probe_steps:
            if statistics.median(probe) * self.margin < statistics.median(kept):
                self.current = self._probe
                self.switches += 1
                self._recent = {size: deque(probe[-self.probe_steps :], maxlen=self.probe_steps)}
                self._interval = self.probe_every_s
            else:  # a probe costs a few slow steps: fewer of them while nothing changes
                self._interval = min(self._interval * 2, self.max_probe_every_s)
            self._end_probe()
        elif self._probe_left <= 0:  # the work changed shape meanwhile: try again later
            self._end_probe()

    def _end_probe(self) -> None:
        self._probe = None
        self._next_probe = self.clock() + self._interval

    def describe(self) -> str:
        if self.fixed:
            return f"{self.current} thread(s), fixed"
        return f"auto: {self.current} of {self.max_threads} thread(s), {self.switches} switch(es)"


_COMPUTE_THREAD: dict[str, int | None] = {"threads": None}


def _torch_set_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)
