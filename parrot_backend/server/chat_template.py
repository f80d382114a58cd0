"""Chat templates rendered in Jinja's immutable sandbox.

A template ships with a model (and, when the operator allows it, with a request); either
way it is untrusted code. The sandbox blocks attribute access to internals (`__class__`,
`__globals__`, ...) and mutation of passed-in objects; on top of it we bound the size of
`*`/`**` results and of the rendered text, so a template cannot exhaust memory either.
"""

from __future__ import annotations

import datetime as _dt
from functools import lru_cache
from typing import Any

from jinja2 import TemplateError
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_REPEAT = 1_000_000  # largest string/list a template may build with `*`
MAX_EXPONENT = 256

# ChatML, what SmolLM2 uses; for engines whose tokenizer ships no template.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    """The template could not be rendered for these messages (or tried something forbidden)."""


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "**" and isinstance(right, int) and abs(right) > MAX_EXPONENT:
            raise SecurityError(f"exponent {right} is too large in a chat template")
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(count, int):
                    if len(seq) * count > MAX_REPEAT:
                        raise SecurityError("repetition too large in a chat template")
        return super().call_binop(context, operator, left, right)


def _raise_exception(message: str) -> None:
    # HF templates call raise_exception("Conversation roles must alternate ...")
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return _dt.datetime.now().strftime(fmt)


_ENV = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, autoescape=False)
_ENV.globals["raise_exception"] = _raise_exception
_ENV.globals["strftime_now"] = _strftime_now


@lru_cache(maxsize=32)
def _compile(source: str):
    return _ENV.from_string(source)


def render_chat(
    source: str | None,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    special_tokens: dict[str, str] | None = None,
    max_chars: int = 2_000_000,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """Render `messages` into one prompt string; raise ChatTemplateError on any failure.

    `tools` (OpenAI-style function definitions) reach templates that take them, as
    Hugging Face's `apply_chat_template(tools=...)` passes them."""
    tokens = special_tokens or {}
    try:
        template = _compile(source if source is not None else DEFAULT_CHAT_TEMPLATE)
        parts: list[str] = []
        size = 0
        for piece in template.generate(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=tokens.get("bos", tokens.get("bos_token", "")) or "",
            eos_token=tokens.get("eos", tokens.get("eos_token", "")) or "",
            tools=tools,
        ):
            size += len(piece)
            if size > max_chars:
                raise ChatTemplateError(f"rendered chat prompt exceeds {max_chars} characters")
            parts.append(piece)
        return "".join(parts)
    except ChatTemplateError:
        raise
    except SecurityError as exc:
        raise ChatTemplateError(f"chat template tried a forbidden operation: {exc}") from None
    except TemplateError as exc:
        raise ChatTemplateError(f"chat template error: {exc}") from None
    except (RecursionError, MemoryError, OverflowError) as exc:
        raise ChatTemplateError(f"chat template too expensive: {type(exc).__name__}") from None
    except Exception as exc:  # TypeError etc. from template expressions on odd inputs
        raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from None


def takes_tools(source: str | None) -> bool:
    """Whether a chat template renders tool definitions itself (it reads `tools`); others
    get them described in a system message (`openai_prep.tool_messages`)."""
    return source is not None and "tools" in source
