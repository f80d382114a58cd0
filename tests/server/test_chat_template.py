"""Chat templates render in a sandbox: templates can never execute code or exhaust memory."""

from __future__ import annotations

import httpx
import pytest

from parrot_backend.server import ServerSettings, create_app
from parrot_backend.server.chat_template import ChatTemplateError, render_chat
from parrot_backend.testing.fake_engine import FakeEngine

from .conftest import AUTH

MSGS = [{"role": "user", "content": "hi"}]


def test_default_template_is_chatml():
    assert render_chat(None, MSGS) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert (
        render_chat(None, MSGS, add_generation_prompt=False) == "<|im_start|>user\nhi<|im_end|>\n"
    )


def test_hf_helpers_available():
    src = (
        "{% if messages|length > 1 %}{{ raise_exception('one message only') }}{% endif %}"
        "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}"
    )
    assert render_chat(src, MSGS, special_tokens={"bos": "<s>", "eos": "</s>"}) == "<s>hi</s>"
    with pytest.raises(ChatTemplateError, match="one message only"):
        render_chat(src, MSGS * 2)
    assert render_chat("{{ strftime_now('%Y') }}", MSGS).isdigit()


def _marker_templates(marker) -> list[str]:
    cmd = f"touch {marker}"
    return [
        # classic SSTI escapes through object internals
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ ().__class__.__base__.__subclasses__() }}",
        f"{{{{ cycler.__init__.__globals__.os.system('{cmd}') }}}}",
        f"{{{{ joiner.__init__.__globals__.os.popen('{cmd}').read() }}}}",
        f"{{{{ namespace.__init__.__globals__.os.system('{cmd}') }}}}",
        f"{{{{ lipsum.__globals__['os'].system('{cmd}') }}}}",
        "{{ raise_exception.__globals__['__builtins__']['__import__']('os')"
        f".system('{cmd}') }}}}",
        "{{ strftime_now.__globals__['_dt'].__builtins__['exec']"
        f"('import os; os.system(\"{cmd}\")') }}}}",
        "{{ self._TemplateReference__context }}",
        "{{ messages.__class__.__init__.__globals__ }}",
        f"{{{{ request.application.__globals__.__builtins__.__import__('os').system('{cmd}') }}}}",
        "{% set x = messages.append({'role': 'evil'}) %}{{ messages|length }}",
        "{% set x = messages[0].update({'content': 'pwned'}) %}{{ messages[0].content }}",
        "{{ messages.pop() }}",
        "{{ 'x' * 100000000 }}",
        "{{ [1] * 100000000 }}",
        "{{ 10 ** 100000 }}",
        "{{ 'a'.format.__globals__ }}",
        "{{ '{0.__class__.__mro__}'.format(1) }}",
        "{% for i in range(1000000000) %}{% endfor %}",
    ]


def test_malicious_templates_cannot_run_code(tmp_path):
    marker = tmp_path / "pwned"
    for src in _marker_templates(marker):
        messages = [{"role": "user", "content": "hi"}]
        try:
            out = render_chat(src, messages)
        except ChatTemplateError:
            pass
        else:
            # some probes render harmlessly to nothing (undefined attributes); none may
            # leak internals or mutate the messages
            assert "subclass" not in out and "function" not in out and "pwned" not in out, src
        assert messages == [{"role": "user", "content": "hi"}], src
        assert not marker.exists(), src


def test_rendered_size_is_bounded():
    src = "{% for i in range(100000) %}{{ messages[0].content }}{% endfor %}"
    with pytest.raises(ChatTemplateError, match="exceeds"):
        render_chat(src, [{"role": "user", "content": "y" * 100}], max_chars=1000)


async def test_malicious_model_template_over_http(tmp_path):
    marker = tmp_path / "pwned"
    engine = FakeEngine(
        chat_template=f"{{{{ cycler.__init__.__globals__.os.system('touch {marker}') }}}}"
    )
    app = create_app(engine, settings=ServerSettings())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        r = await c.post("/v1/chat/completions", json={"model": "fake-model", "messages": MSGS})
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "chat_template_error"
        assert "forbidden" in r.json()["error"]["message"]
        assert (await c.get("/v1/models")).status_code == 200
    assert not marker.exists()
    assert engine.fills == []


async def test_request_templates_off_unless_allowed(tmp_path):
    marker = tmp_path / "pwned"
    evil = f"{{{{ cycler.__init__.__globals__.os.system('touch {marker}') }}}}"
    body = {"model": "fake-model", "messages": MSGS, "max_tokens": 2}
    app = create_app(FakeEngine(), settings=ServerSettings(api_keys={"sk-test-alice": "a"}))
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://t", headers=AUTH
    ) as c:
        r = await c.post("/v1/chat/completions", json={**body, "chat_template": "{{ 1 }}"})
        assert r.status_code == 400 and "disabled" in r.json()["error"]["message"]
    app = create_app(FakeEngine(), settings=ServerSettings(allow_request_chat_template=True))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        ok = await c.post(
            "/v1/chat/completions",
            json={**body, "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"},
        )
        assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == 2
        r = await c.post("/v1/chat/completions", json={**body, "chat_template": evil})
        assert r.status_code == 400
    assert not marker.exists()
