"""Engine membership: the engines a manager runs calls on, and what it knows of each.

One manager serves one model: every engine must have the same `model_name` (prefix keys
and segment tokens are computed once per call, with the first engine's tokenizer).
Engines join (`add`: a remote engine registered) and leave (`remove`: it died or left);
the manager moves the calls of one that left (`Manager.remove_engine`).

Per engine the set keeps the load of the calls this manager runs there (`EngineLoad`),
its KV capacity from the last stats, and the generation limits every engine accepts.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from parrot_backend.contract.engine import EngineClient, EngineStats
from parrot_backend.program import Call, ProgramError

from .policy import EngineSnapshot
from .prefix import PrefixTable

log = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineLoad:
    """The calls this manager runs on one engine: how many, how many are latency calls
    outside task groups, and the KV tokens they may need."""

    batch: int = 0
    latency: int = 0
    tokens: int = 0


class EngineSet:
    """The engines in service (`engines`, by id), their load and limits."""

    def __init__(self, engines: Mapping[str, EngineClient]) -> None:
        if not engines:
            raise ValueError("a manager needs at least one engine")
        models = {e.model_name for e in engines.values()}
        if len(models) != 1:
            raise ValueError(f"one manager serves one model; engines serve {sorted(models)}")
        self.engines = dict(engines)
        self.model = models.pop()
        self.load = {eid: EngineLoad() for eid in self.engines}
        self.capacity: dict[str, int] = {}  # engine id -> KV tokens, from its last stats
        self.limits = _model_limits(self.engines.values())

    def add(self, engine_id: str, engine: EngineClient) -> None:
        """Put an engine in service; raises ValueError for another model or a taken id."""
        if engine.model_name != self.model:
            raise ValueError(
                f"engine {engine_id!r} serves {engine.model_name!r}; "
                f"this manager serves {self.model!r}"
            )
        if engine_id in self.engines:
            raise ValueError(f"engine {engine_id!r} is already in service")
        self.engines[engine_id] = engine
        self.load[engine_id] = EngineLoad()
        self.limits = _model_limits(self.engines.values())

    def remove(self, engine_id: str) -> bool:
        """Take an engine out of service; False if it was not in service. The load of
        its calls stays until they end."""
        if self.engines.pop(engine_id, None) is None:
            return False
        self.capacity.pop(engine_id, None)
        if self.engines:  # the limits of the last engine stand while none is in service
            self.limits = _model_limits(self.engines.values())
        return True

    async def stats(self, engine_id: str) -> EngineStats | None:
        """The engine's stats, or None when it cannot be reached (it takes no work)."""
        try:
            stats = await self.engines[engine_id].stats()
        except Exception:
            log.warning("engine %s: stats failed; skipping it this round", engine_id)
            return None
        self.capacity[engine_id] = stats.blocks_total * stats.block_size
        return stats

    def snapshot(
        self,
        engine_id: str,
        stats: EngineStats | None,
        needed: int,
        keys: set[str],
        table: PrefixTable,
        max_batch: int,
    ) -> EngineSnapshot:
        """What the policy sees of one engine. Only the prefixes this round's calls have
        are listed (`keys`), and idle prefixes count as free memory only when the round
        may need them (`needed` tokens): both would otherwise cost time in the number of
        prefixes held. An engine without stats looks full."""
        if stats is None:
            return EngineSnapshot(engine_id, batch_size=max_batch)
        load = self.load[engine_id]
        free = stats.free_tokens
        if free < needed:
            free += table.evictable_tokens(engine_id)
        held = frozenset(
            k for k in keys if (e := table.get(k)) is not None and e.engine_id == engine_id
        )
        return EngineSnapshot(
            engine_id,
            running_latency=load.latency,
            batch_size=load.batch,
            running_tokens=load.tokens,
            free_kv_tokens=free,
            prefixes=held,
        )

    def check_limits(self, calls: Iterable[Call]) -> None:
        """Generation configs must fit the model: a bad one would fail only at run time.
        Raises ProgramError naming the first few that do not."""
        vocab, context = self.limits
        if vocab is None and context is None:
            return
        problems = [
            f"call {call.name!r}, output {out!r}: {problem}"
            for call in calls
            for out, config in call.configs.items()
            for problem in config.limit_problems(vocab, context)
        ]
        if problems:
            raise ProgramError("; ".join(problems[:5]), problems)


def _model_limits(engines: Iterable[EngineClient]) -> tuple[int | None, int | None]:
    """(vocabulary size, context length) every engine accepts; None where none says."""
    vocab = [v for e in engines if isinstance(v := getattr(e, "vocab_size", None), int)]
    context = [n for e in engines if isinstance(n := getattr(e, "max_model_len", None), int)]
    return (min(vocab) if vocab else None, min(context) if context else None)
