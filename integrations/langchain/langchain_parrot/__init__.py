"""LangChain models for a parrot-backend server: `ChatParrot` (chat) and `ParrotLLM` (text).

Both speak the server's OpenAI-compatible routes; they need langchain-core and httpx only.
"""

from .chat_models import ChatParrot
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
]
