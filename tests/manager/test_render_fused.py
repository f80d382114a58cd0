"""render_call: the plan and prefixes of plan_and_pieces + call_prefixes, in one pass."""

from __future__ import annotations

import gc
from collections.abc import Callable, Mapping
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parrot_backend.manager import prefix, render
from parrot_backend.manager.ingest import CallBuilder
from parrot_backend.manager.prefix import Prefix, call_prefixes
from parrot_backend.manager.render import CallPlan, TokenCache, plan_and_pieces, render_call
from parrot_backend.manager.scripted import ScriptedEngine
from parrot_backend.program import Call, GenerationConfig, RunSpec, Text

SYSTEM = "You are a careful analyst. "


def utf8(text: str) -> list[int]:
    return ScriptedEngine(model_name="noop", record=False).tokenize(text)


def wide(text: str) -> list[int]:
    """Ids over the whole unsigned 32-bit range, two per character."""
    return [t for c in text for t in ((ord(c) * 2654435761) % 2**32, 2**32 - 1 - ord(c))]


def bad(text: str) -> list[int]:
    """A "!" becomes an id outside [0, 2**32): packing it for a key raises ValueError."""
    return [2**32 if c == "!" else ord(c) for c in text]


TOKENIZERS: dict[str, Callable[[str], list[int]]] = {"utf8": utf8, "wide": wide, "bad": bad}
SHARED = {name: TokenCache(tok) for name, tok in TOKENIZERS.items()}  # across examples


def reference(
    call: Call, values: Mapping[str, str], tokens: Any, model: str, salt: str | bytes | None
) -> tuple[CallPlan, tuple[Prefix, ...]]:
    """What the manager did before render_call."""
    plan, pieces = plan_and_pieces(call, values, tokens)
    return plan, tuple(call_prefixes(model, call.segments, values, tokens, salt, pieces))


def outcome(fn: Callable[[], Any]) -> tuple[Any, ...]:
    try:
        return ("ok", fn())
    except Exception as e:  # noqa: BLE001 - compared with the reference's
        return ("error", type(e), e.args)


def assert_same(got: tuple[Any, ...], want: tuple[Any, ...]) -> None:
    if want[0] == "error":
        assert got == want
        return
    assert got[0] == "ok", got
    (plan, prefixes), (ref_plan, ref_prefixes) = got[1], want[1]
    assert type(prefixes) is tuple
    assert prefixes == ref_prefixes
    assert all(type(p) is Prefix for p in prefixes)
    assert plan.prompt == ref_plan.prompt
    assert plan.n_tokens == ref_plan.n_tokens
    assert [(s.output, s.then) for s in plan.steps] == [(s.output, s.then) for s in ref_plan.steps]
    assert all(s.config is r.config for s, r in zip(plan.steps, ref_plan.steps, strict=True))
    assert plan == ref_plan


class Spy:
    """Counts the calls render_call sends the reference way."""

    def __init__(self) -> None:
        self.calls = 0

    def __enter__(self) -> Spy:
        self.orig = render._render_reference

        def spy(*args: Any) -> Any:
            self.calls += 1
            return self.orig(*args)

        render._render_reference = spy
        return self

    def __exit__(self, *exc: object) -> None:
        render._render_reference = self.orig


texts = st.one_of(
    st.sampled_from(["", " ", "\n", "é漢🙂", "!", "a!b", "{", "}}", "\\", SYSTEM]),
    st.text(max_size=6),
)
configs = st.one_of(
    st.none(),
    st.builds(
        GenerationConfig,
        max_tokens=st.integers(1, 64),
        stop=st.lists(st.sampled_from(["\n", "END", "."]), max_size=2),
    ),
)
parts = st.lists(
    st.one_of(
        texts.map(lambda t: ("text", t)),
        st.integers(0, 3).map(lambda i: ("input", f"v{i}")),
        st.integers(0, 3).map(lambda i: ("output", f"o{i}")),
    ),
    max_size=10,
)


def build(parts: list[tuple[str, str]], cfgs: list[GenerationConfig | None]) -> Call | None:
    template, seen = "", set()
    for kind, x in parts:
        if kind == "text":
            template += x
        elif kind == "input":
            template += f"{{{{input:{x}}}}}"  # an input may be read twice
        elif x not in seen:  # an output once
            seen.add(x)
            template += f"{{{{output:{x}}}}}"
    outs = {f"o{i}": c for i, c in enumerate(cfgs) if c is not None and f"o{i}" in seen}
    try:
        return Call.from_template("c", template, outs)
    except ValueError:
        return None


@settings(max_examples=400, deadline=None)
@given(
    parts,
    st.lists(configs, min_size=4, max_size=4),
    st.lists(st.one_of(st.none(), texts), min_size=4, max_size=4),
    st.sampled_from([None, "t:", "tenant-é", b"t:", b"\x00\xff"]),
    st.sampled_from(sorted(TOKENIZERS)),
    st.booleans(),
    st.booleans(),
    st.sampled_from(["noop", "smollm2-135m"]),
)
def test_render_call_equals_the_two_function_path(
    parts: list[tuple[str, str]],
    cfgs: list[GenerationConfig | None],
    values: list[str | None],
    salt: str | bytes | None,
    tokenizer: str,
    shared_cache: bool,
    split_text: bool,
    model: str,
) -> None:
    call = build(parts, cfgs)
    if call is None:
        return  # not a valid template
    if split_text:  # consecutive text segments (parse never makes them; a recipe merges them)
        segs: list[Any] = []
        for seg in call.segments:
            if isinstance(seg, Text) and len(seg.text) > 1:
                segs += [Text(seg.text[:1]), Text(seg.text[1:])]
            else:
                segs.append(seg)
        call = Call(call.name, call.template, tuple(segs), call.configs)
    vals = {f"v{i}": v for i, v in enumerate(values) if v is not None}  # some may be missing
    tokens = SHARED[tokenizer] if shared_cache else TokenCache(TOKENIZERS[tokenizer])
    want = outcome(lambda: reference(call, vals, tokens, model, salt))
    render._SEEN.pop(id(call.segments), None)  # (a tuple of an earlier example may be freed)
    with Spy() as first:
        cold = outcome(lambda: render_call(call, vals, tokens, model, salt))
    with Spy() as spy:
        compiled = outcome(lambda: render_call(call, vals, tokens, model, salt))
        cached = outcome(lambda: render_call(call, vals, tokens, model, salt))
    assert_same(cold, want)
    assert_same(compiled, want)
    assert_same(cached, want)
    if want[0] == "ok":
        assert first.calls <= 1  # a template's first call makes no recipe (unless seen)
        assert spy.calls == 0  # the recipe served the next ones, it did not fall back
        assert compiled[1][0].prompt is not cached[1][0].prompt  # each call's own prompt
    # another call of the same segments with other configs (the CallBuilder shares them)
    other = Call(call.name, call.template, call.segments, {})
    other.configs = {o: GenerationConfig(max_tokens=3) for o in call.outputs}
    for c in (other, call, other):
        assert_same(
            outcome(lambda c=c: render_call(c, vals, tokens, model, salt)),
            outcome(lambda c=c: reference(c, vals, tokens, model, salt)),
        )


def test_exceptions_are_the_reference_ones() -> None:
    tokens = TokenCache(bad)
    call = Call.from_template("c", SYSTEM + "{{input:a}} x {{output:o}} {{input:b}} y")
    for vals in ({}, {"a": "1"}, {"a": "!", "b": "2"}, {"b": "2"}, {"a": "1", "b": "!"}):
        want = outcome(lambda vals=vals: reference(call, vals, tokens, "m", "s"))
        for _ in range(2):
            assert_same(outcome(lambda vals=vals: render_call(call, vals, tokens, "m", "s")), want)
    assert outcome(lambda: render_call(call, {"a": "1"}, tokens, "m", "s"))[1] is KeyError
    assert outcome(lambda: render_call(call, {"a": "!", "b": ""}, tokens, "m", "s"))[1] is (
        ValueError
    )
    assert outcome(lambda: render_call(call, {"a": "1", "b": "!"}, tokens, "m", "s"))[0] == "ok"
    text = Call.from_template("t", "hi! {{input:a}} {{output:o}}")  # bad ids in the text
    for _ in range(2):
        got = outcome(lambda: render_call(text, {"a": "1"}, tokens, "m", None))
        assert got[1] is ValueError
        assert got == outcome(lambda: reference(text, {"a": "1"}, tokens, "m", None))
    missing = Call(call.name, call.template, call.segments, {})  # no config for its output
    want = outcome(lambda: reference(missing, {"a": "1", "b": "2"}, tokens, "m", "s"))
    assert want[1] is KeyError
    assert outcome(lambda: render_call(missing, {"a": "1", "b": "2"}, tokens, "m", "s")) == want


def test_a_raised_exception_carries_no_context_from_the_compiled_path() -> None:
    call = Call.from_template("c", SYSTEM + "{{input:a}} {{output:o}}")
    with pytest.raises(KeyError) as info:
        render_call(call, {}, TokenCache(utf8), "m", None)
    assert info.value.__context__ is None


def test_equal_templates_in_different_calls_do_not_mix() -> None:
    tokens = TokenCache(utf8)
    template = SYSTEM + "{{input:a}} x {{output:o}} y {{output:p}}"
    a = Call.from_template("c", template, {"o": GenerationConfig(max_tokens=5)})
    b = Call.from_template("c", template, {"p": GenerationConfig(max_tokens=9, stop=["."])})
    assert a.segments is not b.segments
    for vals in ({"a": "1"}, {"a": "2"}):
        for call in (a, b, a, b):
            assert_same(
                outcome(lambda call=call, vals=vals: render_call(call, vals, tokens, "m", "s")),
                outcome(lambda call=call, vals=vals: reference(call, vals, tokens, "m", "s")),
            )


def test_salts_models_and_tokenizers_never_mix_keys() -> None:
    call = Call.from_template("c", SYSTEM + "{{input:a}} {{input:b}}: {{output:o}}")
    vals = {"a": "one", "b": "two"}
    caches = [TokenCache(utf8), TokenCache(wide)]
    seen: dict[tuple[Any, ...], tuple[Prefix, ...]] = {}
    for _ in range(2):
        for tokens in caches:
            for model in ("m1", "m2"):
                for salt in (None, "a", b"a", "b", b"b\x00"):
                    got = render_call(call, vals, tokens, model, salt)
                    assert got == reference(call, vals, tokens, model, salt)
                    key = (id(tokens), model, salt)
                    assert seen.setdefault(key, got[1]) == got[1]
    # "a" and b"a" are the same salt bytes (prefix._hasher): equal keys, as the reference
    distinct = {p[-1].key for k, p in seen.items() if not isinstance(k[2], bytes)}
    assert len(distinct) == 2 * 2 * 3  # tokenizers x models x (None, "a", "b")


def test_a_freed_tokenizer_or_segments_id_reused_is_not_a_hit() -> None:
    vals = {"a": "xyz"}
    template = SYSTEM + "{{input:a}} {{output:o}}"
    for _ in range(20):  # a new TokenCache may get a freed one's id: its own recipe then
        tokens = TokenCache(utf8 if _ % 2 else wide)
        call = Call.from_template("c", template)
        assert render_call(call, vals, tokens, "m", "s") == reference(call, vals, tokens, "m", "s")
        del tokens
        gc.collect()
    # segments freed after the cache forgot them: a new tuple may take the id
    tokens = TokenCache(utf8)
    ids = set()
    for i in range(200):
        call = Call.from_template("c", f"{i} " * (i % 3) + "{{input:a}} {{output:o}}" + "z" * i)
        ids.add(id(call.segments))
        assert render_call(call, vals, tokens, "m", None) == reference(
            call, vals, tokens, "m", None
        )
        render._RECIPES.clear()  # as full caches do: only the caches held the tuple
        render._SEEN.clear()
        prefix._CUTS.clear()
        prefix._LEADING.clear()
        del call
        gc.collect()
    assert len(ids) < 200  # ids were reused (CPython), and every result was right
    # a recipe under another tuple's id (what a reused id would find) is not used
    a = Call.from_template("c", SYSTEM + "{{input:a}} A {{output:o}}")
    b = Call.from_template("c", SYSTEM + "{{input:a}} B {{output:o}}")
    render_call(a, vals, tokens, "m", None)
    render_call(a, vals, tokens, "m", None)  # the second call makes the recipe
    render_call(b, vals, tokens, "m", None)  # b seen once: its next call would compile
    render._RECIPES[id(b.segments)] = render._RECIPES[id(a.segments)]
    assert render_call(b, vals, tokens, "m", None) == reference(b, vals, tokens, "m", None)
    assert render_call(a, vals, tokens, "m", None) == reference(a, vals, tokens, "m", None)


def test_cache_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(render, "_CACHE_SIZE", 8)
    tokens = TokenCache(utf8)
    calls = [Call.from_template("c", f"{i} {{{{input:a}}}} {{{{output:o}}}}") for i in range(30)]
    for salt in ("a", "b"):
        for call in calls:
            got = render_call(call, {"a": "v"}, tokens, "m", salt)
            assert got == reference(call, {"a": "v"}, tokens, "m", salt)
            assert sum(len(d) for d in render._RECIPES.values()) <= 8


def test_uncached_inputs_take_the_reference_path() -> None:
    class Slotted:  # no __weakref__: cannot be held weakly
        __slots__ = ()

        def __call__(self, text: str) -> list[int]:
            return utf8(text)

    call = Call.from_template("c", SYSTEM + "{{input:a}} {{output:o}}")
    listed = Call(call.name, call.template, call.segments, call.configs)
    listed.segments = list(call.segments)  # type: ignore[assignment]
    for c, tokens in ((call, Slotted()), (listed, TokenCache(utf8))):
        with Spy() as spy:
            for _ in range(2):
                got = render_call(c, {"a": "1"}, tokens, "m", "s")
                assert got == reference(c, {"a": "1"}, tokens, "m", "s")
        assert spy.calls == 2


def test_benchmark_calls_share_their_steps_and_keep_their_own_prompt() -> None:
    def map_reduce(i: int) -> RunSpec:  # as benchmarks/manager_bench.py builds them
        maps = [
            {
                "name": f"m{k}",
                "template": SYSTEM + f"Text: {{{{input:c{k}}}}} S: {{{{output:s{k}}}}}",
            }
            for k in range(4)
        ]
        reduce = {
            "name": "r",
            "template": "Combine {{input:s0}} {{input:s1}} {{input:s2}} "
            "{{input:s3}}: {{output:total}}",
        }
        inputs = {f"c{k}": f"document {i} part {k}" for k in range(4)}
        return RunSpec.model_validate({"program": {"calls": [*maps, reduce]}, "inputs": inputs})

    builder, tokens = CallBuilder(), TokenCache(utf8)
    plans = []
    for i in range(3):
        spec: RunSpec = map_reduce(i)
        program = builder.program(spec)
        vals = dict(spec.inputs) | {f"s{k}": f"sum {i}.{k}" for k in range(4)}
        for call in program.calls.values():
            with Spy() as spy:
                got = render_call(call, vals, tokens, "noop", "t:")
            assert spy.calls == (1 if i == 0 else 0)  # recipes from each template's 2nd call
            assert got == reference(call, vals, tokens, "noop", "t:")
            plans.append(got[0])
    m0 = [p for k, p in enumerate(plans) if k % 5 == 0]
    # read-only, shared by the calls of one template its recipe renders (from the 2nd)
    assert m0[1].steps is m0[2].steps
    assert m0[1].prompt is not m0[2].prompt
