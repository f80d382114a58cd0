"""A chat app with a long shared system prompt (Bing Copilot style): many users talk to
one assistant whose system prompt runs to thousands of tokens.

Start a server first (`parrot-backend serve`), then:

    .venv/bin/python examples/chat_shared_prompt.py [--url URL] [--users 6] [--turns 2]

The system prompt (~2,000 tokens by default: a role, rules and reference notes) is the
same for every user, and it is the template's constant prefix. Each user is a session of
their own; the server fills the system prompt into the KV cache once and forks every
user's context from it, so a new user costs only their own message. Each later turn is
added to the user's open run after they read the answer before it, like a chat client.
"""

from __future__ import annotations

import asyncio
import time

from common import HttpBackend, Session, arguments, escape, finish, show_calls, texts

from parrot_backend.client import run_async, semantic_function


async def user(backend, reply, first, i: int, turns: int, start: float) -> tuple:
    session = Session(backend)
    with session:
        answer = first(texts.question(i))
    history = ""
    times = []
    for turn in range(turns):
        text = await answer.aget()
        times.append(time.time() - start)
        history += f"User: {texts.question(i + 1000 * turn)}\nAssistant: {text.strip()}\n"
        if turn + 1 < turns:
            with session:
                answer = reply(escape(history), texts.question(i + 1000 * (turn + 1)))
    return session, times, text


async def main() -> None:
    ap = arguments(__doc__)
    ap.add_argument("--users", type=int, default=6)
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=2048, help="system prompt size")
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args()
    system = escape(texts.system_prompt(7, args.prompt_tokens, role="a web search copilot"))

    def first(question):
        pass

    def reply(history, question):
        pass

    first = semantic_function(
        system + "\n\nUser: {{input:question}}\nAssistant: {{output:answer}}",
        max_tokens=args.max_tokens,
        temperature=0,
        stop=["\nUser:"],
    )(first)
    reply = semantic_function(
        system + "\n\n{{input:history}}User: {{input:question}}\nAssistant: {{output:answer}}",
        max_tokens=args.max_tokens,
        temperature=0,
        stop=["\nUser:"],
    )(reply)
    print(
        f"chat: {args.users} users, {args.turns} turns each, a ~{args.prompt_tokens}-token "
        f"shared system prompt, {args.max_tokens} tokens per answer"
    )
    backend = HttpBackend(args.url, timeout_s=120)
    start = time.time()
    results = await asyncio.gather(
        *(user(backend, reply, first, i, args.turns, start) for i in range(args.users))
    )
    took = time.time() - start
    for turn in range(args.turns):
        ts = [times[turn] for _, times, _ in results]
        print(
            f"  turn {turn + 1}: all {args.users} users answered {min(ts):.1f}-{max(ts):.1f}"
            " s after the start"
        )
    print(
        f"\nall users, all turns: {took:.1f} s; user 0's last answer: "
        f"{results[0][2].strip()[:160]!r}\n"
    )
    sessions = [s for s, _, _ in results]
    show_calls(args.url, [s.run_id for s in sessions], start)
    for s in sessions:
        await run_async(backend, s.close())
    finish(backend, [])


if __name__ == "__main__":
    asyncio.run(main())
