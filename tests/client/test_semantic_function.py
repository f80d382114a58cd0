"""The SDK: @semantic_function builds programs lazily and submits them on get()."""

from __future__ import annotations

import subprocess
import sys

import pytest

from parrot_backend.client import InProcessBackend, Session, semantic_function, set_backend
from parrot_backend.manager.manager import Manager
from parrot_backend.program import ProgramError
from parrot_backend.testing.fake_engine import ScriptedEngine


def tail(prompt: str) -> str:
    """Reply with the prompt's last 12 characters in brackets."""
    return f"[{prompt[-12:]}]"


@semantic_function(max_tokens=64)
def write_code(task):
    """You are an expert software engineer. Write python code of {{input:task}}.
    Code: {{output:code}}"""


@semantic_function(max_tokens=64)
def write_test(task, code):
    """You are an experienced QA engineer. You write test code for {{input:task}}.
    Code: {{input:code}}. Your test code: {{output:test}}"""


class Recording(InProcessBackend):
    """An in-process backend that logs what the session sends."""

    def __init__(self, manager: Manager) -> None:
        super().__init__(manager)
        self.sent: list[str] = []

    async def create_run(self, spec):
        self.sent.append(f"create:{len(spec.program.calls)}")
        return await super().create_run(spec)

    async def add_calls(self, run_id, calls, waits=None):
        self.sent.append(f"add:{len(calls)}")
        await super().add_calls(run_id, calls, waits)

    async def set_input(self, run_id, name, value):
        self.sent.append(f"set:{value}")
        await super().set_input(run_id, name, value)


async def test_paper_example_runs_both_calls_as_one_run() -> None:
    engine = ScriptedEngine(reply=tail)
    async with Manager({"e0": engine}) as manager:
        backend = Recording(manager)
        with Session(backend):
            code = write_code("a snake game")
            test = write_test("a snake game", code)
            assert backend.sent == []  # building runs nothing
            result = await test.aget(perf="latency")
        assert backend.sent == ["create:2"]
        code_value = await code.aget()
        assert code_value == "[game.\nCode: ]"
        # the test writer's prompt holds the generated code, substituted server-side
        assert f"Code: {code_value}. Your test code: " in engine.generations[1].prompt
        assert result == "[ test code: ]"


async def test_later_calls_join_the_same_open_run() -> None:
    engine = ScriptedEngine(reply=tail)
    async with Manager({"e0": engine}) as manager:
        backend = Recording(manager)
        with Session(backend) as session:
            code = write_code("a parser")
            await code.aget()
            test = write_test("a parser", code)
            await test.aget(perf="throughput")
            assert backend.sent[:2] == ["create:1", "add:1"]
            assert len(manager.runs) == 1 and session.run_id in manager.runs


async def test_input_variables_can_be_set_after_submission() -> None:
    engine = ScriptedEngine(reply=tail)
    async with Manager({"e0": engine}) as manager:
        backend = Recording(manager)
        with Session(backend) as session:
            task = session.variable()
            code = write_code(task)
            first = write_code("warm-up")
            await first.aget()
            assert backend.sent == ["create:2"]  # the call waits for its input
            await task.aset("a calculator")
            assert backend.sent[-1] == "set:a calculator"
            assert await code.aget() == "[ator.\nCode: ]"


async def test_per_output_config_reaches_the_engine() -> None:
    @semantic_function(max_tokens=64, outputs={"short": {"max_tokens": 3}})
    def two(topic):
        """About {{input:topic}}: {{output:short}} and then {{output:long}}"""

    engine = ScriptedEngine(reply=lambda p: "abcdefgh")
    async with Manager({"e0": engine}) as manager:
        with Session(InProcessBackend(manager)):
            short, long = two("birds")
            assert await short.aget() == "abc"
            assert await long.aget() == "abcdefgh"


def test_sync_get_through_a_threaded_backend() -> None:
    backend = InProcessBackend.threaded(lambda: {"e0": ScriptedEngine(reply=tail)})
    try:
        with Session(backend):
            code = write_code("a snake game")
            assert code.get() == "[game.\nCode: ]"
    finally:
        backend.close()


def test_threaded_backend_as_a_context_manager_stops_its_thread() -> None:
    with InProcessBackend.threaded(lambda: {"e0": ScriptedEngine(reply=tail)}) as backend:
        thread = backend._thread
        assert thread is not None and thread.is_alive()
        with Session(backend):
            assert write_code("a kite").get() == "[kite.\nCode: ]"
    assert not thread.is_alive()
    assert backend.loop.is_closed()
    backend.close()  # closing again does nothing


async def test_sync_get_inside_the_backend_loop_is_refused() -> None:
    async with Manager({"e0": ScriptedEngine()}) as manager:
        with Session(InProcessBackend(manager)):
            code = write_code("x")
            with pytest.raises(RuntimeError, match="aget"):
                code.get()


def test_template_and_signature_must_agree() -> None:
    with pytest.raises(ProgramError, match="not parameters"):

        @semantic_function
        def missing(a):
            """{{input:a}} {{input:b}} {{output:c}}"""

    with pytest.raises(ProgramError, match="not used"):

        @semantic_function
        def unused(a, b):
            """{{input:a}} {{output:c}}"""

    with pytest.raises(ProgramError, match="no \\{\\{output"):

        @semantic_function
        def no_output(a):
            """{{input:a}}"""

    with pytest.raises(TypeError, match="outputs="):
        semantic_function(max_tokenz=3)


def test_template_argument_names_variables_per_call() -> None:
    fn = semantic_function("Q: {{input:q}} A: {{output:a}} B: {{output:b}}")(lambda q: None)
    with Session() as session:
        a, b = fn("why?")
        assert (a.name, b.name) == ("_lambda_-0.a", "_lambda_-0.b")
        [call] = session._calls
        assert call.template == (
            "Q: {{input:_lambda_-0.q}} A: {{output:_lambda_-0.a}} B: {{output:_lambda_-0.b}}"
        )
        assert session._inputs == {"_lambda_-0.q": "why?"}


def test_arguments_must_be_text_or_handles() -> None:
    with Session(), pytest.raises(TypeError, match="str or SemanticVariable"):
        write_code(42)


def test_the_sdk_imports_without_torch() -> None:
    code = "import sys, parrot_backend.client; assert 'torch' not in sys.modules, 'torch loaded'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_default_backend_serves_calls_outside_any_session() -> None:
    backend = InProcessBackend.threaded(lambda: {"e0": ScriptedEngine(reply=tail)})
    set_backend(backend)
    try:
        code = write_code("a calculator")
        test = write_test("a calculator", code)
        assert test.get(perf="throughput").startswith("[")
        assert code.session is test.session  # both calls went to one default run
        assert len(backend.manager.runs) == 1
    finally:
        set_backend(None)
        backend.close()


async def test_awaited_calls_reach_the_engine_at_the_awaited_priority() -> None:
    """The objective a get() asks for is declared with the submission it triggers: the
    calls must not start at throughput priority before the get() itself arrives."""
    engine = ScriptedEngine(reply=tail)
    async with Manager({"e0": engine}) as manager:
        backend = Recording(manager)
        with Session(backend):
            code = write_code("a kite")
            test = write_test("a kite", code)
            await test.aget(perf="latency")
            assert [g.priority for g in engine.generations] == [0, 0]  # created with it
            later = write_code("a boat")
            await later.aget(perf="latency")
            assert "add:1" in backend.sent
            assert engine.generations[-1].priority == 0  # added with it
            bulk = write_code("a cart")
            await bulk.aget(perf="throughput")
            assert engine.generations[-1].priority == 1
