"""The identity caches give what their plain computation gives, and shared objects are
frozen so that a cached value cannot go stale."""

from __future__ import annotations

import dataclasses

import pytest
from pydantic import ValidationError

from parrot_backend.manager.call_task import sampling_of
from parrot_backend.manager.identity_cache import IdentityCache
from parrot_backend.manager.prefix import _boundaries, prefix_boundaries
from parrot_backend.manager.render import CallPlan, Step
from parrot_backend.program import GenerationConfig
from parrot_backend.program.template import parse


def test_a_value_is_computed_once_per_object_by_identity() -> None:
    calls: list[tuple[int, ...]] = []
    cache: IdentityCache[tuple[int, ...], int] = IdentityCache(
        lambda t: calls.append(t) or sum(t), size=2
    )
    a, b = (1, 2), tuple([1, 2])  # equal, not identical
    assert (cache(a), cache(a), cache(b)) == (3, 3, 3)
    assert calls == [a, b]


def test_a_full_cache_starts_over() -> None:
    cache: IdentityCache[tuple[int, ...], int] = IdentityCache(sum, size=2)
    keys = [(i,) for i in range(3)]
    assert [cache(k) for k in keys] == [0, 1, 2]
    assert len(cache) == 1


def test_cached_sampling_equals_the_plain_conversion() -> None:
    for config in (
        GenerationConfig(),
        GenerationConfig(max_tokens=3, temperature=0.5, stop=["x"], seed=7),
    ):
        assert sampling_of(config) == config.to_sampling()
        assert sampling_of(config) is sampling_of(config)


def test_cached_boundaries_equal_the_plain_ones() -> None:
    for text in ("S {{input:a}} t {{input:b}} {{output:o}} x", "{{output:o}}", "plain"):
        segments = tuple(parse(text))
        assert _boundaries(segments) == prefix_boundaries(segments)
        assert _boundaries(list(segments)) == prefix_boundaries(segments)


def test_shared_objects_are_frozen() -> None:
    config = GenerationConfig()
    with pytest.raises(ValidationError):
        config.max_tokens = 5  # type: ignore[misc]
    step = Step("o", config, [])
    plan = CallPlan([1], [step], 1 + config.max_tokens)
    with pytest.raises(dataclasses.FrozenInstanceError):
        step.then = [2]  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.prompt = []  # type: ignore[misc]
