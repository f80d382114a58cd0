"""How many CPU threads the compute thread's torch ops use, chosen from measured steps.

torch parallelises each op over an OpenMP team as large as the machine. A server shares
its cores: when another process keeps one of them busy, every parallel region waits at
its barrier for the team's worker descheduled there, and decode ran 5-10x slower where
losing one core of two should cost about 2x. No setting wins in both cases (the whole
team is ~1.8x faster on a quiet 2-core machine), so `ThreadTuner` measures: every
`probe_every_s` (and first after a few steps) it runs a few steps with another thread count and keeps whichever made
the work cheaper (time per computed token, compared with the steps just before, which
have the same shape of work in a steady stream). A co-located load then costs about its
share of the cores, and the engine goes back to the whole team once the load is gone.

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
        probe_steps: int = 3,
        margin: float = 1.15,
        set_threads: Callable[[int], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.max_threads = max(1, max_threads)
        self.fixed = fixed
        self.current = self.max_threads
        self.probe_every_s = probe_every_s
        self.probe_steps = probe_steps
        self.margin = margin
        self.clock = clock
        self._set = set_threads or _torch_set_threads
        # what the compute thread runs with: one thread serves every engine of a process
        self._applied = _COMPUTE_THREAD if set_threads is None else {"threads": None}
        self._recent: deque[float] = deque(maxlen=probe_steps)  # cost/token at `current`
        self._probe: int | None = None  # the count being tried, if probing
        self._probe_costs: list[float] = []
        self._next_probe = clock()  # the first probe as soon as a few steps were measured
        self.switches = 0

    def candidates(self) -> list[int]:
        """Thread counts worth trying: the whole team, half of it, one."""
        return sorted({self.max_threads, max(1, self.max_threads // 2), 1}, reverse=True)

    def before_step(self) -> int:
        """Apply and return the thread count for the next step."""
        threads = self.current
        if not self.fixed:
            if self._probe is None and self.clock() >= self._next_probe and len(
                self._recent
            ) == self._recent.maxlen:
                others = [n for n in self.candidates() if n != self.current]
                if others:
                    # try the neighbour: fewer threads from the whole team, more from fewer
                    self._probe = others[0] if self.current == self.max_threads else max(
                        n for n in others if n > self.current)
                    self._probe_costs = []
            if self._probe is not None:
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
        if self._probe is None or threads != self._probe:
            self._recent.append(cost)
            return
        self._probe_costs.append(cost)
        if len(self._probe_costs) < self.probe_steps:
            return
        before = statistics.median(self._recent)
        tried = statistics.median(self._probe_costs)
        if tried * self.margin < before:
            self.current = self._probe
            self.switches += 1
            self._recent.clear()
            self._recent.extend(self._probe_costs)
        self._probe = None
        self._next_probe = self.clock() + self.probe_every_s

    def describe(self) -> str:
        if self.fixed:
            return f"{self.current} thread(s), fixed"
        return (f"auto: {self.current} of {self.max_threads} thread(s), "
                f"{self.switches} switch(es)")


_COMPUTE_THREAD: dict[str, int | None] = {"threads": None}


def _torch_set_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)
