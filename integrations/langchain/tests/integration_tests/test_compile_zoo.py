"""compile_chain against a real `parrot-backend serve` (SmolLM2, greedy): for every shape
of chain, the compiled chain's output equals the plain chain's, and each invoke sends the
HTTP requests the plan says (1 when nothing needs the client)."""

from __future__ import annotations

import asyncio
import json
import time
from operator import itemgetter

import httpx
import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.output_parsers import JsonOutputParser, StrOutputParser
from langchain_core.prompts import ChatPromptTemplate, MessagesPlaceholder, PromptTemplate
from langchain_core.runnables import (
    ConfigurableField,
    RunnableBranch,
    RunnableLambda,
    RunnableParallel,
    RunnablePassthrough,
)

from langchain_parrot import (
    ChatParrot,
    ParrotBadRequestError,
    ParrotError,
    ParrotLLM,
    compile_chain,
)

N = 10  # tokens per step: enough to differ, small enough for CPU

DOCS = [
    "Parrots are intelligent birds that live in the tropics and eat seeds.",
    "Rivers carry water from mountains to the sea and shape the land.",
    "Clocks measure time with gears, springs or quartz crystals.",
]
SYSTEM = (
    "You are a careful assistant. You answer in one short sentence, plainly, and you "
    "never add a greeting or a question of your own. "
)


@pytest.fixture(scope="module")
def models(parrot_server):
    kw = {
        "base_url": parrot_server.url,
        "api_key": parrot_server.api_key,
        "temperature": 0,
        "max_tokens": N,
    }
    return ChatParrot(**kw), ParrotLLM(**kw)


def _shapes(chat, llm):
    summarize = PromptTemplate.from_template("Summarize in a few words:\n\n{doc}\n\nSummary:")
    s = StrOutputParser()
    shapes = {}
    # 1. map-reduce summarisation (fixed fan-out, then a reduce over the summaries)
    mapped = {f"s{i}": itemgetter(f"d{i}") | summarize | llm for i in range(3)}
    reduce = PromptTemplate.from_template("Combine: {s0} / {s1} / {s2}\nOverall:")
    shapes["map_reduce"] = (mapped | reduce | llm, {f"d{i}": d for i, d in enumerate(DOCS)}, 1)
    # 2. chain of summaries (refine)
    refine = (
        RunnablePassthrough.assign(a=PromptTemplate.from_template("Summarize: {d0}\n") | llm)
        | RunnablePassthrough.assign(
            b=PromptTemplate.from_template("Summary so far: {a}\nAdd: {d1}\nNew summary:") | llm
        )
        | PromptTemplate.from_template("Summary so far: {b}\nAdd: {d2}\nFinal summary:")
        | llm
    )
    shapes["refine"] = (refine, {f"d{i}": d for i, d in enumerate(DOCS)}, 1)
    # 3. multi-agent fan-out / fan-in: agents read a generated plan as their prefix
    plan = PromptTemplate.from_template(SYSTEM + "Task: {task}\nPlan:") | llm
    agents = {
        f"a{i}": PromptTemplate.from_template(
            "Team plan: {plan}\nYou are agent " + str(i) + ". Your part:"
        )
        | llm
        for i in range(3)
    }
    merge = PromptTemplate.from_template("Parts: {a0} | {a1} | {a2}\nMerged:") | llm
    shapes["multi_agent"] = (
        RunnableParallel(plan=plan) | agents | merge,
        {"task": "build a nest"},
        1,
    )
    # 4. chat with a shared system message and history
    chat_prompt = ChatPromptTemplate.from_messages(
        [("system", SYSTEM), MessagesPlaceholder("history"), ("human", "{question}")]
    )
    history = [HumanMessage("What do parrots eat?"), AIMessage("Seeds and fruit.")]
    shapes["chat_history"] = (
        chat_prompt | chat | s,
        {"history": history, "question": "And where do they live?"},
        1,
    )
    # 5. an .assign pipeline with a dict output
    assign = RunnablePassthrough.assign(summary=summarize | llm).assign(
        title=PromptTemplate.from_template("Title for: {summary}\nTitle:") | llm
    )
    shapes["assign"] = (assign, {"doc": DOCS[0]}, 1)
    # 6. nested parallels
    nested = RunnableParallel(
        outer={
            "x": PromptTemplate.from_template("One word for {t}:") | llm,
            "y": PromptTemplate.from_template("Two words for {t}:") | llm,
        },
        z=PromptTemplate.from_template("A fact about {t}:") | llm,
    )
    shapes["nested_parallel"] = (nested, {"t": "rivers"}, 1)
    # 7. .map() over a list input
    shapes["map_list"] = ((summarize | llm).map(), [{"doc": d} for d in DOCS], 1)
    # 8. a model bound with stop
    shapes["bind_stop"] = (
        PromptTemplate.from_template("List birds:\n1.") | llm.bind(stop=["\n"]),
        {},
        1,
    )
    # 9. a lambda in the middle: one round trip
    middle = (
        PromptTemplate.from_template("A color like {c}:")
        | llm
        | RunnableLambda(lambda text: text.strip().upper()[:20])
        | PromptTemplate.from_template("Say it again: {x}\n")
        | llm
    )
    shapes["lambda_middle"] = (middle, {"c": "red"}, 2)
    # 10. a JSON parser at the end (runs on the client, no request after it)
    json_chain = (
        PromptTemplate.from_template('Reply with {{"answer": "{a}"}} exactly:\n')
        | llm.bind(stop=["}"])
        | RunnableLambda(lambda t: t + "}")
        | RunnableLambda(lambda t: t if t.strip().startswith("{") else '{"x": 1}')
        | JsonOutputParser()
    )
    shapes["json_end"] = (json_chain, {"a": "yes"}, 1)
    # 11. a branch (decided on the client from a generated value)
    branch = (
        PromptTemplate.from_template("Is {t} a bird? Answer:")
        | llm
        | RunnableBranch(
            (lambda v: "yes" in v.lower(), RunnableLambda(lambda v: "BIRD")),
            RunnableLambda(lambda v: "OTHER"),
        )
    )
    shapes["branch"] = (branch, {"t": "a parrot"}, 1)
    # 12. two steps sharing a long static prefix
    long_system = SYSTEM * 6
    two = RunnableParallel(
        a=PromptTemplate.from_template(long_system + "Q: {q1}\nA:") | llm,
        b=PromptTemplate.from_template(long_system + "Q: {q2}\nA:") | llm,
    )
    shapes["shared_prefix"] = (two, {"q1": "Why is the sky blue?", "q2": "Why is grass green?"}, 1)
    # 13. a chat prompt into a text model (its buffer string)
    shapes["chat_to_llm"] = (
        ChatPromptTemplate.from_messages([("system", "Be brief."), ("human", "Name a {kind}.")])
        | llm,
        {"kind": "river"},
        1,
    )
    # 14. picks, partial variables and a mustache template
    mustache = PromptTemplate.from_template(
        "Hello {{name}}, {{{greeting}}}! Reply:", template_format="mustache"
    )
    picks = {"name": itemgetter("person"), "greeting": lambda _: "welcome"} | mustache | llm
    shapes["picks_mustache"] = (picks, {"person": "Ada <3"}, 1)
    partial = PromptTemplate.from_template("{intro} Tell me about {topic}:").partial(
        intro="Please be brief."
    )
    shapes["partial"] = (partial | chat | s, {"topic": "clocks"}, 1)
    # 15. penalties, bound per call and set on a model (a greedy loop they must break alike)
    loop = PromptTemplate.from_template("{x} is a cat. {x} is a cat. {x} is a cat. {x}")
    penalised = llm.model_copy(update={"presence_penalty": 0.5})
    shapes["penalties"] = (
        loop
        | llm.bind(frequency_penalty=1.0)
        | PromptTemplate.from_template("Again: {x}\n")
        | penalised,
        {"x": "A cat"},
        1,
    )
    # 16. values holding template syntax stay data, never placeholders
    shapes["braces_in_values"] = (
        ChatPromptTemplate.from_messages([("system", "Repeat the text."), ("human", "{t}")])
        | chat
        | s,
        {"t": "{t} {{x}} \\{{input:t}} {{output:o}} }{"},
        1,
    )
    # 17. steps that run on the client, Parrot models inside: fallbacks and retries
    missing = chat.model_copy(update={"model": "no-such-model"})
    ask = ChatPromptTemplate.from_messages([("human", "Name a {kind}.")])
    shapes["fallbacks"] = (ask | missing.with_fallbacks([chat]) | s, {"kind": "bird"}, 0)
    shapes["retry"] = (ask | chat.with_retry(stop_after_attempt=2) | s, {"kind": "tree"}, 0)
    # 18. configurable fields (lowered as configured, here by default)
    configurable = llm.configurable_fields(max_tokens=ConfigurableField(id="max_tokens"))
    shapes["configurable"] = (summarize | configurable, {"doc": DOCS[1]}, 1)
    # 19. structured output (a model bound to a response format runs request-level)
    extract = ChatPromptTemplate.from_messages([("human", "Extract the person: {t}")])
    person = {"type": "object", "properties": {"name": {"type": "string"}}, "title": "Person"}
    shapes["structured_output"] = (
        extract | chat.with_structured_output(person),
        {"t": "Alice is 30."},
        0,
    )
    # 20. logit_bias, bound per call and set on a model (lowered into the outputs' configs)
    nudged = llm.model_copy(update={"logit_bias": {28: 100, 13: 3.0}})  # 28 is forced
    shapes["logit_bias"] = (
        loop
        | llm.bind(logit_bias={11: 4.0, 28: -100})
        | PromptTemplate.from_template("Again: {x}\n")
        | nudged,
        {"x": "A parrot"},
        1,
    )
    return shapes


SHAPES = [
    "map_reduce",
    "refine",
    "multi_agent",
    "chat_history",
    "assign",
    "nested_parallel",
    "map_list",
    "bind_stop",
    "lambda_middle",
    "json_end",
    "branch",
    "shared_prefix",
    "chat_to_llm",
    "picks_mustache",
    "partial",
    "penalties",
    "braces_in_values",
    "fallbacks",
    "retry",
    "configurable",
    "structured_output",
    "logit_bias",
]


@pytest.mark.parametrize("shape", SHAPES)
def test_compiled_equals_plain(models, shape):
    chain, given, requests = _shapes(*models)[shape]
    plain = chain.invoke(given)
    compiled = compile_chain(chain)
    got = compiled.invoke(given)
    assert got == plain
    assert compiled.last_requests == requests, compiled.plan()
    assert compiled.plan()["requests"] == requests


def test_lambda_in_the_middle_costs_exactly_one_round_trip(models):
    chain, given, _ = _shapes(*models)["lambda_middle"]
    compiled = compile_chain(chain)
    plan = compiled.plan()
    assert plan["round_trips"] == 1
    assert [s["where"] for s in plan["steps"]] == ["server", "client", "server"]
    assert compiled.invoke(given) == chain.invoke(given)
    assert compiled.last_requests == 2


def test_batch_runs_every_input_in_one_request(models):
    chat, llm = models
    chain = PromptTemplate.from_template(SYSTEM + "Q: {q}\nA:") | llm
    inputs = [{"q": q} for q in ("Why do parrots talk?", "What is a river?", "How do clocks work?")]
    compiled = compile_chain(chain)
    assert compiled.batch(inputs) == chain.batch(inputs)
    assert compiled.last_requests == 1
    assert asyncio.run(compiled.abatch(inputs)) == [chain.invoke(x) for x in inputs]


def test_async_invoke_and_streams_equal_plain(models):
    chat, llm = models
    chain = ChatPromptTemplate.from_messages([("human", "Tell me about {t}.")]) | chat
    given = {"t": "parrots"}
    plain = chain.invoke(given)
    compiled = compile_chain(chain)
    got = asyncio.run(compiled.ainvoke(given))
    assert isinstance(got, AIMessage) and got.content == plain.content
    assert got.response_metadata["finish_reason"] == plain.response_metadata["finish_reason"]
    chunks = list(compiled.stream(given))
    assert len(chunks) > 1 and "".join(c.content for c in chunks) == plain.content
    text_chain = chain | StrOutputParser()

    async def collect():
        return [c async for c in compile_chain(text_chain).astream(given)]

    pieces = asyncio.run(collect())
    assert len(pieces) > 1 and "".join(pieces) == plain.content


def test_logit_bias_reaches_the_model_compiled_and_plain(models, parrot_server):
    """The shape's last model forces token 28: both paths give it N times, and the plan
    runs both models' steps on the server (the bias lowered into their configs)."""
    chat, llm = models
    chain, given, _ = _shapes(chat, llm)["logit_bias"]
    auth = {"Authorization": f"Bearer {parrot_server.api_key}"} if parrot_server.api_key else {}
    forced = httpx.post(
        f"{parrot_server.url}/detokenize", json={"tokens": [28] * N}, headers=auth, timeout=30
    ).json()["prompt"]
    compiled = compile_chain(chain)
    assert chain.invoke(given) == forced
    assert compiled.invoke(given) == forced
    assert [s["where"] for s in compiled.plan()["steps"]].count("server") == 2


class Recorder(BaseCallbackHandler):
    def __init__(self) -> None:
        self.events: list[str] = []
        self.tokens = 0

    def on_chain_start(self, serialized, inputs, **kw):
        self.events.append("chain_start")

    def on_chain_end(self, outputs, **kw):
        self.events.append("chain_end")

    def on_chat_model_start(self, serialized, messages, **kw):
        self.events.append("chat_start")

    def on_llm_start(self, serialized, prompts, **kw):
        self.events.append("llm_start")

    def on_llm_new_token(self, token, **kw):
        self.tokens += 1

    def on_llm_end(self, response, **kw):
        self.events.append("llm_end")


def test_callbacks_see_the_chain_and_each_llm_step(models):
    chat, llm = models
    chain = (
        PromptTemplate.from_template("Write about {t}:")
        | llm
        | RunnableLambda(lambda v: {"text": v})
        | ChatPromptTemplate.from_messages([("human", "Shorten: {text}")])
        | chat
    )
    rec = Recorder()
    compile_chain(chain).invoke({"t": "rivers"}, config={"callbacks": [rec]})
    assert rec.events[0] == "chain_start" and rec.events[-1] == "chain_end"
    assert rec.events.count("llm_start") == 1 and rec.events.count("chat_start") == 1
    assert rec.events.count("llm_end") == 2
    assert rec.tokens >= 2


def test_plan_says_what_runs_where(models):
    chain, _, _ = _shapes(*models)["json_end"]
    plan = compile_chain(chain).plan()
    assert plan["steps"][0]["where"] == "server"
    assert {s["where"] for s in plan["steps"][1:]} == {"client"}
    assert json.dumps(plan)  # plain data


def test_a_batch_with_return_exceptions_fails_only_the_bad_inputs(models):
    chat, _ = models
    chain = ChatPromptTemplate.from_messages([("human", "{q}")]) | chat | StrOutputParser()
    inputs = [{"q": "Name a bird."}, {"wrong": 1}, {"q": "hello " * 9000}, {"q": "Hi"}]
    plain = chain.batch(inputs, return_exceptions=True)
    compiled = compile_chain(chain)
    for got in (
        compiled.batch(inputs, return_exceptions=True),
        asyncio.run(compiled.abatch(inputs, return_exceptions=True)),
    ):
        assert [got[0], got[3]] == [plain[0], plain[3]]
        assert isinstance(got[1], KeyError) and isinstance(plain[1], KeyError)
        assert isinstance(plain[2], ParrotBadRequestError)
        assert isinstance(got[2], ParrotError) and "8192" in str(got[2])  # the reason


def test_a_model_the_server_does_not_serve_is_a_404_as_in_the_plain_chain(models):
    chat, _ = models
    wrong = chat.model_copy(update={"model": "gpt-4"})
    chain = ChatPromptTemplate.from_messages([("human", "{q}")]) | wrong
    for run in (chain.invoke, compile_chain(chain).invoke):
        with pytest.raises(ParrotBadRequestError, match="'gpt-4' does not exist") as info:
            run({"q": "hi"})
        assert info.value.status_code == 404


def test_configurable_fields_are_lowered_as_configured(models):
    chat, _ = models
    configurable = chat.configurable_fields(max_tokens=ConfigurableField(id="max_tokens"))
    chain = ChatPromptTemplate.from_messages([("human", "Tell me about {t}.")]) | configurable
    config = {"configurable": {"max_tokens": 3}}
    compiled = compile_chain(chain)
    got = compiled.invoke({"t": "rivers"}, config=config)
    plain = chain.invoke({"t": "rivers"}, config=config)
    assert got.content == plain.content and got.usage_metadata["output_tokens"] == 3
    assert compiled.last_requests == 1


def test_a_streamed_chat_answer_ends_with_its_metadata_as_chat_parrots(models):
    chat, _ = models
    chain = ChatPromptTemplate.from_messages([("human", "Tell me about {t}.")]) | chat

    def merged(chunks):
        out = chunks[0]
        for c in chunks[1:]:
            out += c
        return out

    plain = merged(list(chain.stream({"t": "clocks"})))
    got = merged(list(compile_chain(chain).stream({"t": "clocks"})))
    assert got.content == plain.content
    assert got.usage_metadata == plain.usage_metadata
    assert got.response_metadata == plain.response_metadata


def test_leaving_a_stream_early_cancels_the_run(parrot_server):
    import httpx

    chat = ChatParrot(
        base_url=parrot_server.url, api_key=parrot_server.api_key, temperature=0, max_tokens=200
    )
    chain = compile_chain(ChatPromptTemplate.from_messages([("human", "{q}")]) | chat)
    for _ in chain.stream({"q": "Tell me a long story."}):
        break
    headers = {"Authorization": f"Bearer {parrot_server.api_key}"}
    deadline = time.monotonic() + 10  # far less than the 200 tokens would take
    while True:
        [run] = httpx.get(f"{parrot_server.url}/v1/runs?limit=1", headers=headers).json()["runs"]
        if run["status"] != "running" or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert run["status"] == "cancelled"


def test_a_batch_with_a_config_per_input_equals_the_plain_batch(models):
    chat, _ = models
    configurable = chat.configurable_fields(max_tokens=ConfigurableField(id="max_tokens"))
    prompt = ChatPromptTemplate.from_messages([("human", "Tell me about {t}.")])
    chain = prompt | configurable | StrOutputParser()
    inputs = [{"t": "rivers"}, {"t": "clocks"}]
    budgets = [{"configurable": {"max_tokens": 3}}, {"configurable": {"max_tokens": 6}}]
    seen = [Recorder(), Recorder()]
    configs = [{**b, "callbacks": [r]} for b, r in zip(budgets, seen, strict=True)]
    compiled = compile_chain(chain)
    assert compiled.batch(inputs, config=configs) == chain.batch(inputs, config=budgets)
    assert compiled.last_requests == 1
    for r in seen:  # each input its own chain run, with its own call under it
        assert r.events[0] == "chain_start" and r.events[-1] == "chain_end"
        assert r.events.count("chat_start") == 1
