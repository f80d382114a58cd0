"""Log probabilities in OpenAI's formats, from the engine's `TokenDelta.logprob` and
`top_logprobs` (token id, logprob pairs).

The numbers are the engine's: the model's log-softmax of the raw logits at each generated
token's position, before penalties, temperature, top-k/top-p and any grammar (JSON mode,
tools) mask (`SamplingParams.logprobs`). A token's text is the tokenizer's decoding of that
token alone, so a token that ends inside a UTF-8 character shows U+FFFD and its `bytes`
are those of that text (as vLLM's); special tokens decode to "". The token that ends a
generation without being part of its text (EOS, a stop token) has no entry, as in
OpenAI's answers. Entries are per choice, and a stream's chunk carries the entries of the
tokens generated since that choice's previous chunk (a token whose text is held back, a
partial character or a possible stop string, goes with the next chunk of its choice).

Legacy completions with `echo` and `logprobs` list the prompt's tokens first (the entries
of the fill that computed the prompt, `ScoredFill`, the same on every choice, on a choice's
first chunk when streamed): the first
prompt token has `null` logprob and alternatives (OpenAI's shape), the others the logprob
given the tokens before and the top alternatives plus the token itself; `text_offset`
starts at 0 with the prompt, and the generated tokens' offsets go on from there.
"""

from __future__ import annotations

from ..contract.engine import EngineClient, PromptEntry, TokenDelta
from .openai_schemas import ChoiceLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob


class TokenTexts:
    """Each token id's text, decoded once per request."""

    def __init__(self, engine: EngineClient) -> None:
        self._engine = engine
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._engine.detokenize([token_id])
        return text


def has_logprob(delta: TokenDelta) -> bool:
    return delta.token_id is not None and delta.logprob is not None


def chat_entries(texts: TokenTexts, deltas: list[TokenDelta]) -> list[TokenLogprob]:
    """Chat's `logprobs.content` entries of these deltas' tokens."""
    out = []
    for d in deltas:
        if not has_logprob(d):
            continue
        token = texts(d.token_id)
        top = [
            TopLogprob(token=texts(t), logprob=lp, bytes=list(texts(t).encode("utf-8")))
            for t, lp in d.top_logprobs or ()
        ]
        out.append(
            TokenLogprob(
                token=token, logprob=d.logprob, bytes=list(token.encode("utf-8")), top_logprobs=top
            )
        )
    return out


def chat_logprobs(texts: TokenTexts, deltas: list[TokenDelta]) -> ChoiceLogprobs:
    return ChoiceLogprobs(content=chat_entries(texts, deltas))


class CompletionOffsets:
    """Legacy completions' logprobs of one choice, built chunk by chunk: `text_offset`
    counts on from the tokens before (each token's offset is the length of the token texts
    before it, from `start`). `take`'s `prompt` (echo with logprobs: the prompt's ids and
    the fill's entries) puts the prompt's tokens first."""

    def __init__(self, texts: TokenTexts, start: int = 0) -> None:
        self._texts = texts
        self.offset = start

    def _prompt(
        self, out: CompletionLogprobs, ids: list[int], entries: list[PromptEntry | None]
    ) -> None:
        for tid, entry in zip(ids, entries, strict=True):
            token = self._texts(tid)
            out.tokens.append(token)
            out.text_offset.append(self.offset)
            self.offset += len(token)
            if entry is None:  # the first token: nothing predicts it
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            logprob, alternatives = entry
            top: dict[str, float] = {}
            for t, lp in alternatives:
                top.setdefault(self._texts(t), lp)
            top.setdefault(token, logprob)  # the prompt's token always (as a sampled one)
            out.token_logprobs.append(logprob)
            out.top_logprobs.append(top)

    def take(
        self,
        deltas: list[TokenDelta],
        prompt: tuple[list[int], list[PromptEntry | None]] | None = None,
    ) -> CompletionLogprobs:
        out = CompletionLogprobs()
        if prompt is not None:
            self._prompt(out, *prompt)
        for d in deltas:
            if not has_logprob(d):
                continue
            token = self._texts(d.token_id)
            top: dict[str, float] = {}
            for t, lp in d.top_logprobs or ():
                top.setdefault(self._texts(t), lp)
            top.setdefault(token, d.logprob)  # the sampled token always (OpenAI's rule)
            out.tokens.append(token)
            out.token_logprobs.append(d.logprob)
            out.top_logprobs.append(top)
            out.text_offset.append(self.offset)
            self.offset += len(token)
        return out
