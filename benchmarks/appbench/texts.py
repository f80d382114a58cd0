"""Deterministic workload texts: documents, system prompts and user questions.

Everything is generated from a seed with `random.Random` over word lists in this file,
so every run, machine and fresh clone sees the same texts and nothing is downloaded. The
texts read as plain (if dull) English, which keeps a small instruct model on-topic.
SmolLM2's tokenizer spends about 1.22 tokens per word on them.
"""

from __future__ import annotations

import random

TOKENS_PER_WORD = 1.22

_TOPICS = {
    "rivers": ("river", "valley", "delta", "current", "sediment", "flood", "bank", "estuary"),
    "clocks": ("clock", "gear", "spring", "escapement", "pendulum", "dial", "hand", "weight"),
    "parrots": ("parrot", "flock", "seed", "feather", "beak", "nest", "forest", "call"),
    "lanterns": ("lantern", "wick", "flame", "oil", "glass", "sailor", "harbour", "night"),
    "bridges": ("bridge", "arch", "cable", "pier", "span", "load", "deck", "engineer"),
    "bakeries": ("bakery", "oven", "dough", "flour", "crust", "baker", "loaf", "morning"),
}
_VERBS = (
    "carries",
    "shapes",
    "moves",
    "holds",
    "turns",
    "guides",
    "feeds",
    "protects",
    "measures",
    "supports",
    "changes",
    "follows",
)
_ADJS = (
    "old",
    "steady",
    "bright",
    "heavy",
    "quiet",
    "careful",
    "narrow",
    "wide",
    "small",
    "strong",
    "slow",
    "busy",
)
_LINKS = (
    "Over many years",
    "In the early morning",
    "During the winter",
    "For most people",
    "In every town",
    "Before the storm",
    "After a long day",
    "At the end of the season",
)
_RULES = (
    "Answer in plain words and keep every answer short.",
    "Never invent facts that the user did not give you.",
    "If a question is unclear, say what you would need to know.",
    "Prefer a list of short points when the user asks for steps.",
    "Keep a friendly and calm tone, even when the user is upset.",
    "Do not repeat the question back to the user.",
    "When you give numbers, say where they come from.",
    "Refuse politely when a request is unsafe, and explain why.",
)

TOPICS = tuple(_TOPICS)


def _sentence(rng: random.Random, words: tuple[str, ...]) -> str:
    a, b = rng.sample(words, 2)
    return (
        f"{rng.choice(_LINKS)}, the {rng.choice(_ADJS)} {a} {rng.choice(_VERBS)} "
        f"the {rng.choice(_ADJS)} {b}."
    )


def document(seed: int, n_tokens: int, topic: str | None = None) -> str:
    """A document of about `n_tokens` SmolLM2 tokens on one topic (picked by seed)."""
    rng = random.Random(f"doc-{seed}")
    words = _TOPICS[topic or TOPICS[seed % len(TOPICS)]]
    out: list[str] = []
    n_words = 0
    while n_words * TOKENS_PER_WORD < n_tokens:
        s = _sentence(rng, words)
        out.append(s)
        n_words += len(s.split())
    return " ".join(out)


def chunks(seed: int, n_chunks: int, chunk_tokens: int) -> list[str]:
    """A long document as `n_chunks` consecutive chunks of about `chunk_tokens` tokens."""
    topic = TOPICS[seed % len(TOPICS)]
    return [document(seed * 1000 + i, chunk_tokens, topic) for i in range(n_chunks)]


def system_prompt(seed: int, n_tokens: int, role: str = "a helpful assistant") -> str:
    """A long system prompt of about `n_tokens` tokens: a role, rules and a knowledge base
    (the paper's shared prompts run to thousands of tokens)."""
    rng = random.Random(f"sys-{seed}")
    head = (
        f"You are {role}. Follow these rules.\n"
        + "\n".join(f"- {r}" for r in rng.sample(_RULES, len(_RULES)))
        + "\nReference notes:\n"
    )
    have = len(head.split()) * TOKENS_PER_WORD
    return head + document(10_000 + seed, max(0, int(n_tokens - have)))


def question(seed: int) -> str:
    """A short user question (10-20 tokens)."""
    rng = random.Random(f"q-{seed}")
    topic = rng.choice(TOPICS)
    thing = rng.choice(_TOPICS[topic])
    return rng.choice(
        (
            f"What does a {thing} do, in one sentence?",
            f"Give me two short facts about the {thing}.",
            f"Why would someone care about a {rng.choice(_ADJS)} {thing}?",
            f"How do I explain the {thing} to a child?",
        )
    )
