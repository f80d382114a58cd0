"""LangChain for a parrot-backend server: `ChatParrot` (chat) and `ParrotLLM` (text) on
the server's OpenAI-compatible routes, and `compile_chain`, which runs a whole LCEL chain
as one server-side program. They need langchain-core and httpx only.
"""

from .chat_models import ChatParrot
from .compile import CompiledChain, compile_chain
from .errors import (
    ParrotAPIError,
    ParrotAuthenticationError,
    ParrotBadRequestError,
    ParrotConnectionError,
    ParrotError,
    ParrotRateLimitError,
    ParrotResponseError,
    ParrotServerError,
    ParrotTimeoutError,
)
from .llms import ParrotLLM

__all__ = [
    "ChatParrot",
    "CompiledChain",
    "ParrotAPIError",
    "ParrotAuthenticationError",
    "ParrotBadRequestError",
    "ParrotConnectionError",
    "ParrotError",
    "ParrotLLM",
    "ParrotRateLimitError",
    "ParrotResponseError",
    "ParrotServerError",
    "ParrotTimeoutError",
    "compile_chain",
]
