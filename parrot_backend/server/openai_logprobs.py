"""Log probabilities in OpenAI's formats, from the engine's `TokenDelta.logprob` and
`top_logprobs` (token id, logprob pairs).

The numbers are the engine's: the model's log-softmax of the raw logits at each generated
token's position, before penalties, temperature, top-k/top-p and any grammar (JSON mode,
tools) mask (`SamplingParams.logprobs`). A token's text is the tokenizer's decoding of that
token alone, so a token that ends inside a UTF-8 character shows U+FFFD and its `bytes`
are those of that text (as vLLM's); a special token shows its spelling ("<|im_end|>").
The token that ends a generation without being part of its text (EOS, a stop token id)
has an entry in legacy completions (scoring harnesses read `token_logprobs[ctx:-1]` of a
1-token generation: the last entry must be the generated token, whatever it is) and
none in chat, as OpenAI's answers. `text_offset` indexes the choice's text: a generated
special token, which the text leaves out, takes no room there, and a token that splits a
character (its text alone is U+FFFD) is at the offset of the text before it that is
whole, so the tokens after a split character (an emoji, CJK) still index the text.
Entries are per choice,
and a stream's chunk carries the entries of the tokens generated since that choice's
previous chunk (a token whose text is held back, a partial character or a possible stop
string, goes with the next chunk of its choice).

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


def special_spellings(engine: EngineClient) -> dict[int, str]:
    """The engine's special tokens' spellings by id (none known: empty)."""
    return {i: s for s, i in (getattr(engine, "special_token_ids", None) or {}).items()}


def spelled_text(engine: EngineClient, ids: list[int]) -> str:
    """The text of token ids with special tokens spelled out (`detokenize` drops them): an
    echoed token-id prompt, whose entries are then offsets into it."""
    special = special_spellings(engine)
    parts: list[str] = []
    run: list[int] = []
    for tid in ids:
        if tid in special:
            if run:
                parts.append(engine.detokenize(run))
                run = []
            parts.append(special[tid])
        else:
            run.append(tid)
    if run:
        parts.append(engine.detokenize(run))
    return "".join(parts)


class TokenTexts:
    """Each token id's text, decoded once per request (special tokens spelled out), and
    which deltas end a generation without being part of its text (`ended_by`)."""

    def __init__(self, engine: EngineClient, stop_token_ids: list[int] | tuple = ()) -> None:
        self._engine = engine
        self._texts: dict[int, str] = {}
        self._special = special_spellings(engine)
        self._ends = frozenset(getattr(engine, "eos_ids", None) or ()) | frozenset(stop_token_ids)

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            spelled = self._special.get(token_id)
            text = spelled if spelled is not None else self._engine.detokenize([token_id])
            self._texts[token_id] = text
        return text

    @property
    def special(self) -> dict[int, str]:
        return self._special

    def decode(self, ids: list[int]) -> str:
        """The text of these (non-special) tokens decoded together."""
        return self._engine.detokenize(ids)

    def in_text(self, token_id: int) -> bool:
        """Whether a generated token's text is in the choice's text (special ones are not)."""
        return token_id not in self._special

    def ended_by(self, delta: TokenDelta) -> bool:
        """The EOS or stop token id that ended a generation (not part of its text)."""
        return delta.finish_reason == "stop" and delta.token_id in self._ends


def has_logprob(delta: TokenDelta) -> bool:
    return delta.token_id is not None and delta.logprob is not None


def chat_entries(texts: TokenTexts, deltas: list[TokenDelta]) -> list[TokenLogprob]:
    """Chat's `logprobs.content` entries of these deltas' tokens."""
    out = []
    for d in deltas:
        if not has_logprob(d) or texts.ended_by(d):  # (chat lists no EOS)
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
    counts on from the tokens before (each token's offset is the length of the text before
    it, from `start`). `take`'s `prompt` (echo with logprobs: the prompt's ids and the
    fill's entries) puts the prompt's tokens first.

    A token's own text is U+FFFD where it holds part of a character (a byte-level BPE
    splits most emoji and many CJK characters over 2-4 tokens), one character or none in
    the text, though its `tokens` entry is one or two long: summing those lengths would
    push every later offset past the text. Such tokens are held (`_pending`) until their
    decoding together ends in a whole character; each is at the offset of the whole text
    before it, and the run then advances the offset by its decoded length."""

    MAX_PENDING = 16  # tokens held at most (invalid UTF-8 that never completes)

    def __init__(self, texts: TokenTexts, start: int = 0) -> None:
        self._texts = texts
        self.offset = start  # where the held tokens' text starts (all of it, when none)
        self._pending: list[int] = []
        self._pending_text = ""

    def _flush(self) -> None:
        self.offset += len(self._pending_text)
        self._pending, self._pending_text = [], ""

    def _place(self, tid: int, token: str, in_text: bool = True) -> int:
        """The offset of this token in the text, and the offset moved past it."""
        if not in_text:  # a generated special token: no room in the text
            return self.offset + len(self._pending_text.rstrip("\ufffd"))
        if tid in self._texts.special:  # a prompt's special token, spelled in the text
            self._flush()
            at = self.offset
            self.offset += len(token)
            return at
        if not self._pending and "\ufffd" not in token:
            at = self.offset
            self.offset += len(token)
            return at
        at = self.offset + len(self._pending_text.rstrip("\ufffd"))
        self._pending.append(tid)
        self._pending_text = self._texts.decode(self._pending)
        if not self._pending_text.endswith("\ufffd") or len(self._pending) >= self.MAX_PENDING:
            self._flush()
        return at

    def _prompt(
        self, out: CompletionLogprobs, ids: list[int], entries: list[PromptEntry | None]
    ) -> None:
        for tid, entry in zip(ids, entries, strict=True):
            token = self._texts(tid)
            out.tokens.append(token)
            out.text_offset.append(self._place(tid, token))
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
            out.text_offset.append(self._place(d.token_id, token, self._texts.in_text(d.token_id)))
        return out
