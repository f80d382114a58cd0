"""Constrained decoding in the engine, on the tiny *random* model (its free output is noise):
every constrained output still matches its JSON schema, regex or choice; a fork and a
continuation keep the grammar state (equal to one unbroken generation); the constrained
sampler equals the plain one when its mask allows everything; refusals name the problem."""

from __future__ import annotations

import asyncio
import json
import math
import re
import sys

import jsonschema_rs
import pytest
import torch

from parrot_backend.contract.errors import InvalidRequest
from parrot_backend.contract.sampling import Constraint, SamplingParams
from parrot_backend.engine.engine import Engine
from parrot_backend.engine.grammar import GrammarCompiler, GrammarError, check, closed
from parrot_backend.engine.sampler import Sampler, grammar_masks

from .helpers import collect

SEEDS = (None, 1, 2)  # greedy and two sampled runs of every constraint
MAX_TOKENS = 160

_S = {"type": "string", "maxLength": 6}  # free strings are bounded: noise never closes a quote
_I = {"type": "integer", "minimum": -50, "maximum": 50}


def _obj(props: dict, required: list[str] | None = None) -> dict:
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
    }


SCHEMAS: list[dict] = [
    _obj({"name": _S}),
    _obj({"age": _I}),
    _obj({"ok": {"type": "boolean"}}),
    _obj({"nothing": {"type": "null"}}),
    _obj({"x": {"type": "number"}}),
    _obj({"x": {"type": "number", "minimum": 0, "maximum": 10}}),
    _obj({"n": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 9}}),
    _obj({"n": {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100}}),
    _obj({"color": {"enum": ["red", "green", "blue"]}}),
    _obj({"mixed": {"enum": [1, "two", None, True, 3.5]}}),
    _obj({"kind": {"const": "point"}, "x": _I, "y": _I}),
    _obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
    _obj({"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{2,3}$"}}),
    _obj({"word": {"type": "string", "minLength": 2, "maxLength": 4}}),
    _obj({"day": {"type": "string", "format": "date"}}),
    _obj({"at": {"type": "string", "format": "time"}}),
    _obj({"id": {"type": "string", "format": "uuid"}}),
    _obj({"tags": {"type": "array", "items": _S, "maxItems": 3}}),
    _obj({"xs": {"type": "array", "items": _I, "minItems": 2, "maxItems": 4}}),
    _obj(
        {
            "pair": {
                "type": "array",
                "prefixItems": [_I, {"type": "boolean"}],
                "items": False,
                "minItems": 2,
            }
        }
    ),
    _obj(
        {
            "grid": {
                "type": "array",
                "maxItems": 2,
                "items": {"type": "array", "items": _I, "maxItems": 2},
            }
        }
    ),
    _obj({"user": _obj({"id": _I, "name": _S})}),
    _obj({"a": _obj({"b": _obj({"c": _obj({"d": {"type": "boolean"}})})})}),
    _obj({"v": {"anyOf": [_I, _S, {"type": "null"}]}}),
    _obj({"shape": {"anyOf": [_obj({"r": _I}), _obj({"w": _I, "h": _I})]}}),
    _obj({"v": {"type": ["integer", "null"], "minimum": 0, "maximum": 9}}),
    _obj(
        {"name": _S, "age": _I, "email": {"type": "string", "pattern": "^[a-z]{1,5}@x\\.io$"}},
        required=["name"],
    ),
    _obj({"opt": _I}, required=[]),
    {"allOf": [_obj({"a": _I}, required=["a"]), {"properties": {"a": {"maximum": 5}}}]},
    {
        "$defs": {"leaf": _obj({"v": _I})},
        "type": "object",
        "properties": {"left": {"$ref": "#/$defs/leaf"}, "right": {"$ref": "#/$defs/leaf"}},
        "required": ["left", "right"],
        "additionalProperties": False,
    },
    {
        "$defs": {
            "node": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "v": _I,
                    "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]},
                },
                "required": ["v", "next"],
            }
        },
        "$ref": "#/$defs/node",
    },
    {
        "type": "array",
        "items": _obj({"k": {"enum": ["a", "b"]}, "n": _I}),
        "minItems": 1,
        "maxItems": 3,
    },
    {"type": "array", "items": {"type": "boolean"}, "minItems": 3, "maxItems": 3},
    {"type": "integer", "minimum": 100, "maximum": 999},
    {"type": "string", "pattern": "^(yes|no|maybe)$"},
    {"enum": ["alpha", "beta", {"gamma": 1}]},
]


def parse_json(text: str):
    """`json.loads`, except that a number beyond float range (JSON has no range: noise
    writes `-68E50665`) becomes the largest float of its sign instead of infinity, which
    no schema validator takes for a number; within-range numbers are unchanged."""

    def number(spelled: str) -> float:
        value = float(spelled)
        return value if abs(value) != float("inf") else math.copysign(sys.float_info.max, value)

    return json.loads(text, parse_float=number)


def valid(schema: dict, text: str) -> bool:
    return jsonschema_rs.validator_for(schema).is_valid(parse_json(text))


def _engine(tiny_model_dir, **kw) -> Engine:
    return Engine.from_pretrained(tiny_model_dir, num_blocks=512, progress=False, **kw)


def _sampling(constraint: Constraint, seed: int | None, **kw) -> SamplingParams:
    if seed is None:
        return SamplingParams(max_tokens=MAX_TOKENS, constraint=constraint, **kw)
    return SamplingParams(
        max_tokens=MAX_TOKENS, temperature=1.0, seed=seed, constraint=constraint, **kw
    )


async def _generate_all(
    engine: Engine, constraints: list[Constraint], prompt: str
) -> list[tuple[Constraint, int | None, str, str]]:
    """Every constraint under every seed, all at once (one batch), each in a fork of one
    filled prompt; returns (constraint, seed, text, finish reason)."""
    await engine.fill("prompt", None, engine.tokenize(prompt))

    async def one(i: int, c: Constraint, seed: int | None):
        _, text, deltas = await collect(engine, f"c{i}-{seed}", "prompt", _sampling(c, seed))
        return c, seed, text, deltas[-1].finish_reason

    return await asyncio.gather(*(one(i, c, s) for i, c in enumerate(constraints) for s in SEEDS))


def test_every_json_schema_output_validates(tiny_model_dir):
    assert len(SCHEMAS) >= 30
    engine = _engine(tiny_model_dir)
    constraints = [Constraint("json_schema", json.dumps(s)) for s in SCHEMAS]

    async def main():
        async with engine:
            return await _generate_all(engine, constraints, "Reply with JSON:")

    results = asyncio.run(main())
    assert len(results) == len(SCHEMAS) * len(SEEDS)
    for constraint, seed, text, finish in results:
        schema = json.loads(constraint.spec)
        assert finish == "stop", (schema, seed, text)
        assert valid(schema, text), (schema, text)
    # noise, not one canned answer: the sampled runs of a schema differ somewhere
    assert len({text for _, seed, text, _ in results if seed is not None}) > len(SCHEMAS)


REGEXES = [
    r"[0-9]{3}-[0-9]{4}",
    r"[a-z]{1,8}@[a-z]{1,6}\.(com|org)",
    r"(red|green|blue)",
    r"#[0-9a-f]{6}",
    r"-?[0-9]{1,4}(\.[0-9]{1,2})?",
    r"[A-Z][a-z]{1,8}( [A-Z][a-z]{1,8}){0,2}",
    r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])",
    r"(ab|cd){2,3}x?",
    r"[^\s]{1,5}",
    r"true|false",
    r"\(\d{2}\) \[[a-c]\]",
    r"[ \t]?(yes|no)\.",
]


def test_every_regex_output_matches(tiny_model_dir):
    engine = _engine(tiny_model_dir)
    # every pattern here must be finite or bounded enough for noise to finish it
    constraints = [Constraint("regex", r) for r in REGEXES]

    async def main():
        async with engine:
            return await _generate_all(engine, constraints, "Pattern:")

    for constraint, seed, text, finish in asyncio.run(main()):
        assert finish == "stop", (constraint.spec, seed, text)
        assert re.fullmatch(constraint.spec, text), (constraint.spec, seed, text)


CHOICES = [
    ("yes", "no"),
    ("positive", "negative", "neutral"),
    ("a", "ab", "abc"),  # prefixes of each other: the model (or the length) decides
    ('say "hi"', "back\\slash", "new\nline", "tab\there"),
    ("ünïcödé", "日本語", "emoji 🦜"),
    ("{{output:x}}", "<|im_end|> as text", "   spaces   "),
]


def test_every_choice_output_is_one_of_the_choices(tiny_model_dir):
    engine = _engine(tiny_model_dir)
    constraints = [Constraint("choice", c) for c in CHOICES]

    async def main():
        async with engine:
            return await _generate_all(engine, constraints, "Choose:")

    results = asyncio.run(main())
    for constraint, seed, text, finish in results:
        assert finish == "stop", (constraint.spec, seed, text)
        assert text in constraint.spec, (constraint.spec, seed, text)
    picked = {text for c, _, text, _ in results if c.spec == CHOICES[1]}
    assert picked <= set(CHOICES[1])


FORK_SCHEMA = Constraint(
    "json_schema",
    json.dumps(
        {"type": "array", "items": _obj({"name": _S, "n": _I}), "minItems": 4, "maxItems": 4}
    ),
)


def test_fork_continues_its_parents_grammar_state(tiny_model_dir):
    """A generation cut at k tokens, then continued in a fork (and in a fork of the fork)
    under the same constraint, equals one unbroken greedy generation."""
    engine = _engine(tiny_model_dir)
    prompt = engine.tokenize("List four people as JSON:")

    async def main():
        async with engine:
            await engine.fill("whole", None, prompt)
            whole = await collect(engine, "whole", None, _sampling(FORK_SCHEMA, None))
            await engine.fill("p", None, prompt)
            a = await collect(
                engine, "p", None, SamplingParams(max_tokens=7, constraint=FORK_SCHEMA)
            )
            b = await collect(
                engine, "c1", "p", SamplingParams(max_tokens=9, constraint=FORK_SCHEMA)
            )
            c = await collect(engine, "c2", "c1", _sampling(FORK_SCHEMA, None))
            # a sibling fork of the parent continues the same state independently
            d = await collect(engine, "c3", "p", _sampling(FORK_SCHEMA, None))
            return whole, a, b, c, d

    whole, a, b, c, d = asyncio.run(main())
    assert a[2][-1].finish_reason == "length" and b[2][-1].finish_reason == "length"
    assert a[0] + b[0] + c[0] == whole[0]
    assert a[1] + b[1] + c[1] == whole[1]
    assert a[0] + d[0] == whole[0]
    assert valid(json.loads(FORK_SCHEMA.spec), whole[1])


def test_continuation_on_the_same_context_keeps_the_state_and_a_fill_resets_it(tiny_model_dir):
    engine = _engine(tiny_model_dir)
    prompt = engine.tokenize("JSON:")

    async def main():
        async with engine:
            await engine.fill("whole", None, prompt)
            whole = await collect(engine, "whole", None, _sampling(FORK_SCHEMA, None))
            await engine.fill("x", None, prompt)
            first = await collect(
                engine, "x", None, SamplingParams(max_tokens=10, constraint=FORK_SCHEMA)
            )
            rest = await collect(engine, "x", None, _sampling(FORK_SCHEMA, None))
            # after a fill the context no longer ends where the grammar left off: new value
            await engine.fill("x", None, engine.tokenize("\nAgain:"))
            again = await collect(engine, "x", None, _sampling(FORK_SCHEMA, None))
            return whole, first, rest, again

    whole, first, rest, again = asyncio.run(main())
    assert first[1] + rest[1] == whole[1]
    assert again[1].startswith("[{") and json.loads(again[1])


def test_unconstrained_children_of_a_constrained_parent_are_free(tiny_model_dir):
    """The grammar state is kept only for generations under the same constraint."""
    engine = _engine(tiny_model_dir)
    prompt = engine.tokenize("Go:")
    free = SamplingParams(max_tokens=6, ignore_eos=True)

    async def main():
        async with engine:
            await engine.fill("p", None, prompt)
            await collect(engine, "p", None, SamplingParams(max_tokens=3, constraint=FORK_SCHEMA))
            after_constrained = await collect(engine, "k", "p", free)
            other = Constraint("regex", "[0-9]{3}")
            digits = await collect(
                engine, "k2", "p", SamplingParams(max_tokens=8, constraint=other)
            )
            await engine.fill("q", None, engine.context_tokens("p"))
            plain = await collect(engine, "q", None, free)
            return after_constrained, digits, plain

    after_constrained, digits, plain = asyncio.run(main())
    assert after_constrained[0] == plain[0]
    assert re.fullmatch("[0-9]{3}", digits[1])


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(max_tokens=1),
        SamplingParams(max_tokens=1, temperature=0.8, seed=3),
        SamplingParams(max_tokens=1, temperature=1.3, top_k=50, seed=4),
        SamplingParams(max_tokens=1, temperature=0.7, top_p=0.9, seed=5),
    ],
    ids=["greedy", "temperature", "top-k", "top-p"],
)
def test_constrained_sampler_with_an_all_allowing_mask_equals_the_plain_sampler(sampling):
    plain, masked = Sampler(sampling), Sampler(sampling)
    masked.grammar = object()  # only its presence matters to the sampler
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        logits = torch.randn(4096, generator=g) * 4
        masked.banned = [torch.zeros(4096, dtype=torch.bool)]
        assert masked(logits) == plain(logits)


def test_batched_masks_equal_each_matchers_own_mask(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    compiler = GrammarCompiler(tokenizer, 49152, frozenset({2}))
    states = [compiler.start(Constraint("json_schema", json.dumps(s)), 0) for s in SCHEMAS[:8]]
    states.append(compiler.start(Constraint("choice", ("yes", "no")), 0))
    for state, token in zip(
        states, tokenizer.encode('{"', add_special_tokens=False) * 8, strict=False
    ):
        state.consume(token)  # different states: some advanced, the choice at its start
    for state, masks in zip(states, grammar_masks(states, 49152), strict=True):
        (banned,) = masks
        allowed = torch.tensor(list(state.matcher.compute_logit_bias()), dtype=torch.int32) > 0
        assert torch.equal(~banned, allowed[:49152])
        assert 0 < int(allowed.sum()) < 49152


def _allowed(state):
    return torch.tensor(list(state.matcher.compute_logit_bias()), dtype=torch.int32)[:49152] > 0


def test_masks_ahead_of_draft_tokens_are_the_masks_after_consuming_them(tiny_model_dir):
    """A constrained row with draft tokens samples after each kept draft: its masks are
    the grammar's masks after each draft token, and its state is left where it was."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    compiler = GrammarCompiler(tokenizer, 49152, frozenset({2}))
    schema = {"type": "object", "properties": {"name": {"type": "string"}}}
    text = '{"name": "Ada Lovelace"}'
    tokens = tokenizer.encode(text, add_special_tokens=False)
    a = compiler.start(Constraint("json_schema", json.dumps(schema)), 0)
    b = compiler.start(Constraint("regex", "[a-z]+"), 0)
    assert a.valid_prefix(tokens) == len(tokens)
    assert b.valid_prefix(tokens) == 0 and b.valid_prefix([]) == 0
    draft = tokens[:4]
    before = _allowed(a)
    masks = grammar_masks([a, b], 49152, [draft, None])
    assert len(masks[0]) == 5 and len(masks[1]) == 1
    assert torch.equal(_allowed(a), before)  # rolled back
    by_hand = a.fork()
    for i in range(5):
        assert torch.equal(~masks[0][i], _allowed(by_hand)), i
        if i < 4:
            by_hand.consume(draft[i])
    assert torch.equal(~masks[1][0], _allowed(b))


def test_forced_tokens_are_what_the_grammar_allows_alone(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    compiler = GrammarCompiler(tokenizer, 49152, frozenset({2}))
    schema = {
        "type": "object",
        "properties": {"answer_in_full": {"type": "string"}},
        "required": ["answer_in_full"],
    }
    state = compiler.start(Constraint("json_schema", json.dumps(schema)), 0)
    forced = state.forced(16)
    assert tokenizer.decode(forced).startswith('{"answer')  # the only object it allows
    assert state.forced(2) == forced[:2] and state.forced(0) == []
    for token in forced:  # each is the only token its position allows
        allowed = _allowed(state)
        assert int(allowed.sum()) == 1 and bool(allowed[token])
        state.consume(token)


def test_compiled_grammars_are_cached_by_spec(tiny_model_dir):
    from transformers import AutoTokenizer

    compiler = GrammarCompiler(
        AutoTokenizer.from_pretrained(str(tiny_model_dir)), 49152, frozenset({2}), max_cached=2
    )
    a, b, c = (Constraint("regex", r) for r in ("a+", "b+", "c+"))
    assert compiler.compile(a) is compiler.compile(a)
    compiler.compile(Constraint("regex", "a+", require_complete=True))  # same grammar
    assert (compiler.hits, compiler.misses) == (2, 1)
    compiler.compile(b)
    compiler.compile(c)  # evicts a, the least recently used
    assert not compiler.is_cached(a) and compiler.is_cached(b) and compiler.is_cached(c)


@pytest.mark.parametrize(
    ("schema", "named"),
    [
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        ({"not": {"type": "string"}}, "not"),
        ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "if, then"),
        ({"type": "array", "contains": {"type": "integer"}}, "contains"),
        ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ],
)
def test_unsupported_schema_keywords_are_named(schema, named):
    with pytest.raises(GrammarError, match=f"does not support: {named}$"):
        check(Constraint("json_schema", json.dumps(schema)))


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (Constraint("json_schema", "{not json"), "not valid JSON"),
        (Constraint("json_schema", "[1, 2]"), "must be a JSON object"),
        (Constraint("json_schema", json.dumps({"type": "bogus"})), "Invalid type: bogus"),
        (
            Constraint("json_schema", json.dumps({"type": "string", "format": "x-no"})),
            "Unknown format",
        ),
        (Constraint("regex", "[a-z"), "unclosed character class"),
        (Constraint("choice", ()), "non-empty list"),
        (Constraint("choice", ("a", "")), "non-empty list"),
        (Constraint("lark", "start: nothere"), "nothere"),
        (Constraint("sql", "x"), "kind must be one of"),
    ],
)
def test_malformed_constraints_are_invalid_requests(constraint, message):
    with pytest.raises(InvalidRequest, match=re.escape(message)):
        check(constraint)


def test_engine_refuses_bad_constraints_and_combinations(tiny_model_dir):
    engine = _engine(tiny_model_dir)
    bad = Constraint("json_schema", json.dumps({"type": "array", "uniqueItems": True}))
    ok = Constraint("regex", "[0-9]+")

    async def main():
        async with engine:
            await engine.fill("p", None, engine.tokenize("x"))
            for sampling, message in [
                (SamplingParams(constraint=bad), "uniqueItems"),
                (SamplingParams(constraint=ok, stop=["\n"]), "stop strings cannot"),
                (SamplingParams(constraint=ok, ignore_eos=True), "ignore_eos cannot"),
            ]:
                with pytest.raises(InvalidRequest, match=message):
                    await collect(engine, "p", None, sampling)
            # the context is untouched and serves a good request afterwards
            return await collect(engine, "p", None, SamplingParams(max_tokens=4, constraint=ok))

    tokens, text, _ = asyncio.run(main())
    assert re.fullmatch("[0-9]+", text) and len(tokens) == 4


def test_require_complete_fails_a_cut_generation_instead_of_ending_it(tiny_model_dir):
    engine = _engine(tiny_model_dir)
    schema = Constraint("json_schema", FORK_SCHEMA.spec, require_complete=True)

    async def main():
        async with engine:
            await engine.fill("p", None, engine.tokenize("x"))
            with pytest.raises(GrammarError, match="not complete after 5 tokens"):
                await collect(engine, "f", "p", SamplingParams(max_tokens=5, constraint=schema))
            loose = Constraint("json_schema", FORK_SCHEMA.spec)
            cut = await collect(engine, "q", "p", SamplingParams(max_tokens=5, constraint=loose))
            done = await collect(engine, "r", "p", _sampling(schema, None))
            return cut, done

    cut, done = asyncio.run(main())
    assert cut[2][-1].finish_reason == "length"
    assert done[2][-1].finish_reason == "stop" and json.loads(done[1])


@pytest.mark.parametrize(
    ("schema", "expected"),
    [
        (
            {"type": "object", "properties": {"a": {"type": "integer"}}},
            {
                "type": "object",
                "properties": {"a": {"type": "integer"}},
                "additionalProperties": False,
            },
        ),
        (
            {"properties": {"a": {}}, "additionalProperties": True},
            {"properties": {"a": {}}, "additionalProperties": True},
        ),
        (
            {"type": "array", "items": {"properties": {"x": {}}}},
            {"type": "array", "items": {"properties": {"x": {}}, "additionalProperties": False}},
        ),
        (
            {"anyOf": [{"properties": {"q": {}}}], "$defs": {"n": {"properties": {}}}},
            {
                "anyOf": [{"properties": {"q": {}}, "additionalProperties": False}],
                "$defs": {"n": {"properties": {}, "additionalProperties": False}},
            },
        ),
        # properties combined with branches stay open, branches too
        (
            {"properties": {"a": {}}, "anyOf": [{"properties": {"b": {}}}]},
            {"properties": {"a": {}}, "anyOf": [{"properties": {"b": {}}}]},
        ),
        ({"allOf": [{"properties": {"a": {}}}]}, {"allOf": [{"properties": {"a": {}}}]}),
        ({"type": "object"}, {"type": "object"}),  # no properties listed: any object
    ],
    ids=[
        "object",
        "explicitly-open",
        "items",
        "branches-and-defs",
        "combined",
        "allOf",
        "any-object",
    ],
)
def test_objects_that_list_properties_are_closed(schema, expected):
    assert closed(schema) == expected


def test_a_closed_schema_keeps_noise_from_adding_keys(tiny_model_dir):
    engine = _engine(tiny_model_dir)
    schema = {"type": "object", "properties": {"n": _I}, "required": ["n"]}

    async def main():
        async with engine:
            return await _generate_all(
                engine, [Constraint("json_schema", json.dumps(schema))], "JSON:"
            )

    for _, _, text, finish in asyncio.run(main()):
        assert finish == "stop" and list(json.loads(text)) == ["n"], text
