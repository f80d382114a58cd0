"""parrot-backend: application-aware LLM serving with semantic variables."""

__version__ = "0.1.0"
