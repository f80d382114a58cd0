"""Scheduling policy: which ready calls go to which engine now. Pure: snapshots in, decisions out.

Each round the manager passes the ready calls (`PendingCall`, with their deduced objective,
task group and prefixes) and a snapshot of every engine (`EngineSnapshot`). `schedule`
returns the assignments; calls not assigned stay pending for the next round.

Policy, in order of precedence:

1. **No starvation.** A call that has waited longer than `aging_s` is *aged*: aged calls
   are placed first (oldest first) and may join a batch beyond the latency capacity (up to
   `max_batch`). An aged call that does not fit anywhere *reserves* the engine with the
   most free KV: nothing younger is placed there this round, so that engine drains until
   the aged call fits.
2. **Latency before throughput.** Then latency calls, then throughput calls, oldest first.
   A latency call goes to an engine whose running batch is below `latency_capacity`,
   so it decodes in a small, fast batch; when no batch is that small, it joins one
   whose running latency calls are fewer than `latency_capacity` (up to `max_batch`):
   a batch of throughput work drains no sooner if it waits, and the engine runs it
   first (priority). Throughput calls fill the
   rest: up to `max_batch` on engines running no latency call, and only below
   `latency_capacity` on engines that do (they must not slow those calls down).
   **Forks of one prefix go together**: latency calls (outside task groups) offered in
   the same round that share a prefix (e.g. many users of one system prompt) form a
   family, keyed by the longest prefix two or more of them have. Once one member is
   placed, the others join it on the same engine up to `max_batch` (KV permitting)
   whatever the latency capacity: queued behind the capacity they would start only when
   the first wave had finished decoding, while decoding them in one batch costs a step
   only a little longer, and they fork from one fill of the prefix.
3. **Prefix locality.** Among the engines where a call fits, it goes to the one holding
   its longest prefix (it forks from that context and skips those tokens of prefill and
   KV); ties go to the smaller batch, then to fewer running tokens. A throughput call
   prefers engines running no latency call. Prefixes a call is sent to fill count as held
   for the rest of the round, so calls sharing a prefix follow each other.
4. **Task groups are gang-scheduled.** All pending members of a group are placed in the
   same round or none is (an aged group places what fits). Members are batched for
   throughput: they obey the throughput caps whatever the group's objective. When the
   members share a prefix they are kept together on one engine (the one holding the
   longest shared prefix among those with room for all); otherwise, or when no engine
   has room for all, they are spread, each to the least loaded engine. A latency group
   goes before throughput work; a group whose members are all throughput goes after it.

Knobs (`PolicyConfig`): `latency_capacity`, `max_batch`, `aging_s`.

What the policy is offered: when more calls are ready than the engines have batch slots,
only the calls of the dispatch window (`dispatch_window.py`, which states its rule).

Memory: a call needs `n_tokens` (prompt plus max new tokens) minus the tokens of the
longest prefix the engine holds; it fits when that is at most the engine's free KV tokens.
The manager may count tokens it could evict (`PrefixTable.evictable_tokens`) as free.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from parrot_backend.program import Criterion

from .prefix import Prefix


@dataclass(slots=True, frozen=True)
class PolicyConfig:
    """Knobs of the scheduling policy (see the module docstring)."""

    latency_capacity: int = 8  # batch size below which an engine still takes latency calls
    max_batch: int = 256  # batch size no engine exceeds
    aging_s: float = 10.0  # seconds after which a waiting call goes first


@dataclass(slots=True)
class EngineSnapshot:
    """What the scheduler knows about one engine at decision time.

    `running_latency` counts latency calls running outside task groups; `batch_size`
    counts all running calls; `prefixes` are the keys of prefixes filled on the engine.
    """

    engine_id: str
    running_latency: int = 0
    batch_size: int = 0
    running_tokens: int = 0
    free_kv_tokens: int = 0
    prefixes: frozenset[str] = field(default_factory=frozenset)


@dataclass(slots=True)
class PendingCall:
    """A ready call waiting for an engine (read-only; not frozen only because that costs
    ~0.7 us more per call to make).

    `n_tokens`: KV tokens it needs with no prefix reused (prompt plus max new tokens).
    `prefixes`: its prefixes, shortest first (`prefix.call_prefixes`). `group`: its task
    group, unique across runs (e.g. `"<run id>/<group id>"`), or None.
    """

    call_id: str
    objective: Criterion
    n_tokens: int
    enqueued_at: float
    prefixes: tuple[Prefix, ...] = ()
    group: str | None = None


@dataclass(slots=True)
class Assignment:
    """Run `call_id` on `engine_id`, forking from `prefix` when the engine holds it
    (read-only, as PendingCall)."""

    call_id: str
    engine_id: str
    prefix: Prefix | None


@dataclass(slots=True)
class RoundLoad:
    """An engine's load as this round's decisions change it (snapshots stay untouched)."""

    engine_id: str
    running_latency: int
    batch_size: int
    running_tokens: int
    free_kv_tokens: int
    prefixes: set[str] | frozenset[str]
    # a trial copy shares `prefixes` read-only and keeps the ones its placements add here
    # (copying the set for every trial would cost in the prefixes placed this round)
    extra: set[str] | None = None

    @classmethod
    def of(cls, e: EngineSnapshot) -> RoundLoad:
        return cls(
            e.engine_id,
            e.running_latency,
            e.batch_size,
            e.running_tokens,
            e.free_kv_tokens,
            set(e.prefixes),
        )

    def trial(self) -> RoundLoad:
        """A copy to try placements on; this load must not change while the copy is used."""
        held = self.prefixes if not self.extra else self.prefixes | self.extra
        return RoundLoad(
            self.engine_id,
            self.running_latency,
            self.batch_size,
            self.running_tokens,
            self.free_kv_tokens,
            held,
            set(),
        )


@dataclass(slots=True)
class _Unit:
    """What is placed as a whole: one call, or the pending members of one task group."""

    calls: list[PendingCall]
    aged: bool
    latency: bool
    since: float


def schedule(
    pending: Iterable[PendingCall],
    engines: Sequence[EngineSnapshot],
    now: float,
    config: PolicyConfig | None = None,
) -> list[Assignment]:
    """Assign pending calls to engines for this round, following the module's policy."""
    config = config or PolicyConfig()
    state = {e.engine_id: RoundLoad.of(e) for e in engines}
    reserved: set[str] = set()
    out: list[Assignment] = []
    open_engines = list(state.values())  # those not reserved (made again when one is)
    max_batch = config.max_batch
    units = _units(pending, now, config)
    family = _families(units)
    joined: dict[str, RoundLoad] = {}  # family key -> the engine its first member went to
    for unit in units:
        if not unit.aged:
            for s in open_engines:
                if s.batch_size < max_batch:
                    break
            else:
                break  # nothing fits any more, and no later unit is aged (they come first)
        # placements are tried on copies of the engines' loads (a group is all or
        # nothing); what a successful try made of them is this round's state from then on
        placed: tuple[list[Assignment], list[RoundLoad]] | None
        if _single(unit):
            # one call: trial copies would reach the same engine; place it on the state
            call = unit.calls[0]
            fam = family.get(call.call_id) if family else None
            engine = None
            # a fork joins its family's engine up to max_batch (the cap of an aged call)
            for key in fam or ():
                e = joined.get(key)
                if e is not None and e.engine_id not in reserved:
                    if _fits(call, e, config, aged=True, batched=False):
                        engine = e
                        break
            if engine is None:
                engine = _best(call, open_engines, config, unit.aged, batched=False)
            if engine is not None:
                out.append(_commit(call, engine, single=True))
                for key in fam or ():
                    joined.setdefault(key, engine)
                continue
            # an aged call that fits nowhere fits nowhere either when tried again as
            # part of what fits (`_fits` of an aged call ignores `batched`)
            placed = None
        else:
            placed = _place_unit(unit, open_engines, config)
            if placed is None and unit.aged:
                placed = _place_each(unit.calls, open_engines, config, aged=True, partial=True)
        if placed is not None:
            out.extend(placed[0])
            for trial in placed[1]:
                _adopt(state[trial.engine_id], trial)
        n_placed = 0 if placed is None else len(placed[0])
        if unit.aged and n_placed < len(unit.calls) and open_engines:
            # the aged work did not fit: hold the roomiest engine for it until it drains
            reserved.add(max(open_engines, key=lambda s: (s.free_kv_tokens, s.engine_id)).engine_id)
            open_engines = [s for eid, s in state.items() if eid not in reserved]
    return out


def _single(unit: _Unit) -> bool:
    """Whether `unit` is a call outside any task group (it counts as running latency)."""
    return len(unit.calls) == 1 and unit.calls[0].group is None


def _units(pending: Iterable[PendingCall], now: float, config: PolicyConfig) -> list[_Unit]:
    """Group the calls and order them: aged, then latency, then throughput; oldest first."""
    singles: list[PendingCall] = []
    groups: dict[str, list[PendingCall]] = {}
    for call in pending:
        if call.group is None:
            singles.append(call)
        else:
            groups.setdefault(call.group, []).append(call)
    units = [_unit([c], now, config) for c in singles]
    units += [_unit(sorted(m, key=lambda c: c.call_id), now, config) for m in groups.values()]
    units.sort(key=lambda u: (not u.aged, not u.latency, u.since, u.calls[0].call_id))
    return units


def _families(units: list[_Unit]) -> dict[str, list[str]]:
    """Call id -> family keys of each latency call outside task groups that shares a
    prefix with another one: its prefixes that two or more of them have, longest first
    (two users asking the same question share a longer prefix than the system prompt
    all users share; they belong to both families)."""
    forks = [
        u.calls[0]
        for u in units
        if u.latency and len(u.calls) == 1 and u.calls[0].group is None and u.calls[0].prefixes
    ]
    if len(forks) < 2:
        return {}
    counts = Counter(p.key for c in forks for p in c.prefixes)
    out: dict[str, list[str]] = {}
    for c in forks:
        keys = [p.key for p in reversed(c.prefixes) if counts[p.key] >= 2]
        if keys:
            out[c.call_id] = keys
    return out


def _unit(calls: list[PendingCall], now: float, config: PolicyConfig) -> _Unit:
    if len(calls) == 1:  # most units: no generators for the min and the any
        c = calls[0]
        return _Unit(
            calls, now - c.enqueued_at > config.aging_s, c.objective == "latency", c.enqueued_at
        )
    since = min(c.enqueued_at for c in calls)
    latency = any(c.objective == "latency" for c in calls)
    return _Unit(calls, now - since > config.aging_s, latency, since)


def _matched(call: PendingCall, engine: RoundLoad) -> Prefix | None:
    """The longest prefix of `call` that `engine` holds."""
    held, extra = engine.prefixes, engine.extra
    for prefix in reversed(call.prefixes):
        if prefix.key in held or (extra is not None and prefix.key in extra):
            return prefix
    return None


def _fits(
    call: PendingCall, engine: RoundLoad, config: PolicyConfig, aged: bool, batched: bool
) -> bool:
    """Whether `engine` can take `call` now; `batched`: the call obeys throughput caps."""
    if aged:
        cap = config.max_batch
    elif call.objective == "latency" and not batched:
        cap = config.latency_capacity
    else:
        cap = config.latency_capacity if engine.running_latency else config.max_batch
    if engine.batch_size >= min(cap, config.max_batch):
        return False
    hit = _matched(call, engine)
    need = call.n_tokens - (hit.n_tokens if hit else 0)
    return need <= engine.free_kv_tokens


def _rank(call: PendingCall, engine: RoundLoad, batched: bool) -> tuple:
    """Sort key of an engine for `call`: longest prefix, then least loaded."""
    hit = _matched(call, engine)
    avoid_latency = bool(engine.running_latency) and (batched or call.objective != "latency")
    return (
        -(hit.n_tokens if hit else 0),
        avoid_latency,
        engine.batch_size,
        engine.running_tokens,
        engine.engine_id,
    )


def _best(
    call: PendingCall,
    engines: Iterable[RoundLoad],
    config: PolicyConfig,
    aged: bool,
    batched: bool,
) -> RoundLoad | None:
    fitting = [e for e in engines if _fits(call, e, config, aged, batched)]
    if not fitting and not aged and not batched and call.objective == "latency":
        # every batch is at the latency capacity: join one made of throughput work (its
        # calls leave no sooner if this one waits, and it runs first in the engine)
        cap = config.latency_capacity
        fitting = [
            e
            for e in engines
            if e.running_latency < cap and _fits(call, e, config, aged=True, batched=False)
        ]
    if len(fitting) < 2:  # nothing to rank
        return fitting[0] if fitting else None
    return min(fitting, key=lambda e: _rank(call, e, batched))


def _place_unit(
    unit: _Unit, engines: list[RoundLoad], config: PolicyConfig
) -> tuple[list[Assignment], list[RoundLoad]] | None:
    """All calls of `unit` placed on trial copies (`_place_each`), or None when they do
    not all fit."""
    batched = not _single(unit)
    if batched and _shared_prefix(unit.calls) is not None:
        for engine in sorted(engines, key=lambda e: _rank(unit.calls[0], e, True)):
            together = _place_each(unit.calls, [engine], config, unit.aged, partial=False)
            if together is not None:
                return together
    return _place_each(unit.calls, engines, config, unit.aged, partial=False, batched=batched)


def _place_each(
    calls: list[PendingCall],
    engines: list[RoundLoad],
    config: PolicyConfig,
    aged: bool,
    partial: bool,
    batched: bool = True,
) -> tuple[list[Assignment], list[RoundLoad]] | None:
    """Place calls one by one on copies of `engines`; None if one fails and not `partial`.

    Returns the assignments and the copies as the placements left them: `_adopt` them
    to keep the placements (the calls count as `single` when not `batched`)."""
    trials = [e.trial() for e in engines]
    placed: list[Assignment] = []
    for call in calls:
        engine = _best(call, trials, config, aged, batched)
        if engine is None:
            if partial:
                continue
            return None
        placed.append(_commit(call, engine, single=not batched))
    return placed, trials


def _adopt(engine: RoundLoad, trial: RoundLoad) -> None:
    """Make `engine` what its trial copy became: as if the trial's calls were committed
    to it in the same order (the copy started equal to it and nothing else changed it)."""
    engine.running_latency = trial.running_latency
    engine.batch_size = trial.batch_size
    engine.running_tokens = trial.running_tokens
    engine.free_kv_tokens = trial.free_kv_tokens
    if trial.extra:
        added = engine.prefixes if engine.extra is None else engine.extra
        assert isinstance(added, set)
        added.update(trial.extra)


def _shared_prefix(calls: Sequence[PendingCall]) -> str | None:
    """A prefix key every call has, or None."""
    common = {p.key for p in calls[0].prefixes}
    for call in calls[1:]:
        common &= {p.key for p in call.prefixes}
    return next(iter(common), None)


def _commit(call: PendingCall, engine: RoundLoad, single: bool) -> Assignment:
    """Account for `call` running on `engine`; the engine will hold its prefixes after."""
    hit = _matched(call, engine)
    engine.batch_size += 1
    engine.running_tokens += call.n_tokens
    engine.free_kv_tokens -= call.n_tokens - (hit.n_tokens if hit else 0)
    if single and call.objective == "latency":
        engine.running_latency += 1
    added = engine.prefixes if engine.extra is None else engine.extra
    assert isinstance(added, set)
    for p in call.prefixes:
        added.add(p.key)
    return Assignment(call.call_id, engine.engine_id, hit)
