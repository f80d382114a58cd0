"""Prefix analysis: boundaries, keys, salts, and the table of filled prefixes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from parrot_backend.manager.prefix import Prefix, PrefixTable, prefix_boundaries, prefix_key
from parrot_backend.manager.render import PromptTokenizer, render_call
from parrot_backend.program import Call, parse

MODEL = "smollm2-135m"
SYSTEM = "You are a careful assistant. "


def tokenize(text: str) -> list[int]:
    """A toy tokenizer: one token per character."""
    return [ord(c) for c in text]


TOKENS = PromptTokenizer(tokenize)


def prefixes(template: str, values: dict[str, str], salt: str | None = "tenant-a"):
    return render_call(Call.from_template("c", template), values, TOKENS, MODEL, salt)[1]


def keys(template: str, values: dict[str, str], salt: str | None = "tenant-a") -> list[str]:
    return [p.key for p in prefixes(template, values, salt)]


def test_boundaries_follow_leading_text_inputs_and_first_output() -> None:
    segs = parse("S {{input:a}} m {{input:b}} t {{output:o}} x {{input:c}}")
    # segments S a m b t o x c: after S, after a, after b, and the 5 before o
    assert prefix_boundaries(segs) == [1, 2, 4, 5]


def test_template_without_output_stops_at_its_last_input() -> None:
    assert prefix_boundaries(parse("S {{input:a}} tail")) == [1, 2]


def test_template_starting_with_output_has_no_prefix() -> None:
    assert prefix_boundaries(parse("{{output:o}} x")) == []


def test_keys_match_prefix_key_of_the_token_prefix() -> None:
    template = SYSTEM + "{{input:doc}} Q: {{input:q}} A: {{output:a}}"
    values = {"doc": "D", "q": "why"}
    plan, found = render_call(Call.from_template("c", template), values, TOKENS, MODEL, "s")
    assert [p.n_segments for p in found] == [1, 2, 4, 5]
    for p in found:
        assert p.key == prefix_key(MODEL, plan.prompt[: p.n_tokens], "s")


def test_static_prefix_key_is_shared_across_runs_with_different_inputs() -> None:
    template = SYSTEM + "{{input:q}} {{output:a}}"
    assert keys(template, {"q": "one"})[0] == keys(template, {"q": "two"})[0]
    assert keys(template, {"q": "one"})[1] != keys(template, {"q": "two"})[1]


def test_equal_prefixes_in_different_templates_share_keys() -> None:
    a = keys(SYSTEM + "{{input:doc}} Summarize: {{output:s}}", {"doc": "D"})
    b = keys(SYSTEM + "{{input:doc}} Translate: {{output:t}}", {"doc": "D"})
    assert a[:2] == b[:2]
    assert a[2] != b[2]


def test_dynamic_prefix_generated_value_is_shared_by_its_readers() -> None:
    plan = {"plan": "step 1, step 2"}
    readers = [
        keys(f"{{{{input:plan}}}} You are agent {i}: {{{{output:r{i}}}}}", plan) for i in range(3)
    ]
    assert readers[0][0] == readers[1][0] == readers[2][0]
    assert len({r[-1] for r in readers}) == 3


def test_different_salts_give_different_keys() -> None:
    template = SYSTEM + "{{input:q}} {{output:a}}"
    assert keys(template, {"q": "x"}, "tenant-a") != keys(template, {"q": "x"}, "tenant-b")


def test_public_prefix_has_one_key_for_every_tenant() -> None:
    template = SYSTEM + "{{input:q}} {{output:a}}"
    public = keys(template, {"q": "x"}, None)
    assert public == keys(template, {"q": "x"}, None)
    assert public[0] != keys(template, {"q": "x"}, "tenant-a")[0]


def test_model_is_part_of_the_key() -> None:
    assert prefix_key("m1", [1, 2], None) != prefix_key("m2", [1, 2], None)


def test_key_is_a_stable_digest() -> None:
    # pinned: the key must not change between processes or releases (it is stored)
    assert prefix_key("m", [1, 2, 3], None) == prefix_key("m", [1, 2, 3], None)
    assert len(prefix_key("m", [1], b"salt")) == 64
    assert prefix_key("m", [1], b"salt") == prefix_key("m", [1], "salt")


def test_salt_and_tokens_cannot_run_into_each_other() -> None:
    assert prefix_key("m", [0x31], "a") != prefix_key("m", [], "a1")


def test_empty_value_does_not_duplicate_a_prefix() -> None:
    assert [p.n_tokens for p in prefixes("S{{input:e}}{{output:o}}", {"e": ""}, None)] == [1]


def test_out_of_range_token_is_rejected() -> None:
    with pytest.raises(ValueError, match="token ids"):
        prefix_key("m", [-1], None)


@given(
    st.lists(st.text(max_size=5), min_size=1, max_size=5),
    st.one_of(st.none(), st.text(max_size=4)),
    st.sampled_from(["sys ", "", "x", "a longer system prompt "]),
)
def test_incremental_keys_equal_one_shot_keys(
    values: list[str], salt: str | None, lead: str
) -> None:
    template = lead + " ".join(f"{{{{input:v{i}}}}}" for i in range(len(values))) + "{{output:o}}"
    vals = {f"v{i}": v for i, v in enumerate(values)}
    plan, found = render_call(Call.from_template("c", template), vals, TOKENS, MODEL, salt)
    assert plan.prompt == tokenize("".join([lead, " ".join(values)]))
    for p in found:
        assert p.key == prefix_key(MODEL, plan.prompt[: p.n_tokens], salt)
    assert [p.n_tokens for p in found] == sorted({p.n_tokens for p in found})


# --- PrefixTable ---------------------------------------------------------------------------


def table_with(*specs: tuple[str, int, float]) -> PrefixTable:
    table = PrefixTable()
    for key, n, now in specs:
        table.insert(key, "e0", f"ctx-{key}", n, now)
    return table


def test_released_prefix_outlives_its_run() -> None:
    table = table_with(("k", 10, 0.0))
    table.acquire("k", 1.0)
    table.release("k", 2.0)
    entry = table.get("k")
    assert entry is not None and entry.refcount == 0 and entry.last_used == 2.0
    assert table.held("e0") == {"k"}


def test_evict_takes_least_recently_used_first_and_stops_when_enough() -> None:
    table = table_with(("old", 10, 1.0), ("mid", 10, 2.0), ("new", 10, 3.0))
    dropped = table.evict("e0", 15)
    assert [e.key for e in dropped] == ["old", "mid"]
    assert "new" in table and len(table) == 1


def test_evict_never_drops_a_prefix_in_use() -> None:
    table = table_with(("busy", 10, 0.0), ("idle", 10, 5.0))
    table.acquire("busy", 1.0)
    assert [e.key for e in table.evict("e0", 100)] == ["idle"]
    assert "busy" in table


def test_evict_is_per_engine() -> None:
    table = PrefixTable()
    table.insert("a", "e0", "c1", 10, 0.0)
    table.insert("b", "e1", "c2", 10, 0.0)
    assert [e.key for e in table.evict("e1", 100)] == ["b"]
    assert table.held("e0") == {"a"} and table.held("e1") == frozenset()


def test_child_pins_parent_and_is_evicted_first() -> None:
    table = PrefixTable()
    table.insert("sys", "e0", "c-sys", 100, 0.0)
    table.insert("sys+doc", "e0", "c-doc", 150, 1.0, parent="sys")
    assert table.get("sys").refcount == 1  # type: ignore[union-attr]
    assert table.get("sys+doc").own_tokens == 50  # type: ignore[union-attr]
    dropped = table.evict("e0", 120)
    assert [e.key for e in dropped] == ["sys+doc", "sys"]


def test_parent_of_a_busy_child_is_not_evictable() -> None:
    table = PrefixTable()
    table.insert("sys", "e0", "c-sys", 100, 0.0)
    table.insert("sys+doc", "e0", "c-doc", 150, 1.0, parent="sys")
    table.insert("other", "e0", "c-o", 30, 2.0)
    table.acquire("sys+doc", 3.0)
    assert table.evictable_tokens("e0") == 30
    assert [e.key for e in table.evict("e0", 1000)] == ["other"]
    table.release("sys+doc", 4.0)
    assert table.evictable_tokens("e0") == 150


def test_parent_must_live_on_the_same_engine() -> None:
    table = PrefixTable()
    table.insert("sys", "e0", "c", 10, 0.0)
    with pytest.raises(ValueError, match="engine e0"):
        table.insert("child", "e1", "c2", 20, 0.0, parent="sys")


def test_release_more_than_acquire_is_an_error() -> None:
    table = table_with(("k", 1, 0.0))
    with pytest.raises(ValueError, match="released"):
        table.release("k", 1.0)


def test_insert_twice_is_an_error() -> None:
    table = table_with(("k", 1, 0.0))
    with pytest.raises(ValueError, match="already"):
        table.insert("k", "e0", "c", 1, 0.0)


def test_longest_finds_the_deepest_filled_prefix() -> None:
    table = table_with(("p1", 5, 0.0), ("p2", 9, 0.0))
    prefixes = [Prefix("p1", 1, 5), Prefix("p2", 2, 9), Prefix("p3", 3, 12)]
    hit = table.longest(prefixes)
    assert hit is not None and hit[0].key == "p2" and hit[1].context_id == "ctx-p2"
    assert table.longest([Prefix("zz", 1, 1)]) is None


def test_drop_engine_forgets_its_prefixes() -> None:
    table = table_with(("a", 1, 0.0), ("b", 1, 0.0))
    assert {e.key for e in table.drop_engine("e0")} == {"a", "b"}
    assert len(table) == 0


def test_has_idle_follows_the_refcounts() -> None:
    """`has_idle` (kept by counting) says whether any entry of the engine has refcount 0,
    through inserts with parents, acquires, releases, evictions and dropped engines."""
    import random

    rng = random.Random(7)
    for _ in range(200):
        table = PrefixTable()
        held: list[str] = []
        n = 0
        for _ in range(rng.randint(1, 40)):
            op = rng.random()
            engine = rng.choice(["e0", "e1"])
            keys_on = [k for k in (table.held("e0") | table.held("e1")) if table.get(k)]
            if op < 0.35:
                parents = [k for k in keys_on if table.get(k).engine_id == engine]  # type: ignore[union-attr]
                parent = rng.choice(parents) if parents and rng.random() < 0.5 else None
                up = table.get(parent).n_tokens if parent else 0  # type: ignore[union-attr]
                n += 1
                table.insert(f"k{n}", engine, f"c{n}", up + rng.randint(1, 5), float(n), parent)
            elif op < 0.6 and keys_on:
                key = rng.choice(sorted(keys_on))
                table.acquire(key, float(n))
                held.append(key)
            elif op < 0.85 and held:
                table.release(held.pop(rng.randrange(len(held))), float(n))
            elif op < 0.97:
                table.evict(engine, rng.randint(1, 10))
            else:
                table.drop_engine(engine)
                held = [k for k in held if table.get(k) is not None]
            for e in ("e0", "e1"):
                idle = any(table.get(k).refcount == 0 for k in table.held(e))  # type: ignore[union-attr]
                assert table.has_idle(e) == idle
