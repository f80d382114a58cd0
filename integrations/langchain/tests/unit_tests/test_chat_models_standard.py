"""langchain-tests' standard unit suite for ChatParrot (nothing overridden or skipped here)."""

from __future__ import annotations

from langchain_tests.unit_tests import ChatModelUnitTests

from langchain_parrot import ChatParrot

from .fakes import MODEL


class TestChatParrotUnit(ChatModelUnitTests):
    """Capability flags: see integrations/langchain/README.md (Standard tests)."""

    @property
    def chat_model_class(self) -> type[ChatParrot]:
        return ChatParrot

    @property
    def chat_model_params(self) -> dict:
        # A port nothing listens on: unit tests must not reach a server.
        return {"model": MODEL, "base_url": "http://127.0.0.1:9"}

    @property
    def supports_json_mode(self) -> bool:
        # response_format {"type": "json_object"}: decoding is constrained to a JSON object.
        # (Tool calling, tool_choice and structured output are detected from bind_tools and
        # with_structured_output.)
        return True

    @property
    def init_from_env_params(self) -> tuple[dict, dict, dict]:
        return (
            {"PARROT_BASE_URL": "http://parrot.example:8000", "PARROT_API_KEY": "sk-env"},
            {},
            {"base_url": "http://parrot.example:8000", "api_key": "sk-env"},
        )
