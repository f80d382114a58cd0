"""GPTs-style serving: several apps, each a long system prompt of its own, used by many
users at once.

Start a server first (`parrot-backend serve`), then:

    .venv/bin/python examples/gpts_apps.py [--url URL] [--apps 3] [--users 4]

Each app is a `@semantic_function` whose template begins with its system prompt (a role,
rules and ~800 tokens of reference notes). Every user is a session of their own (one run
each, as separate clients would be), all submitted concurrently. The server sees that the
runs of one app begin with the same text, fills that prefix into the KV cache once and
forks each user's context from it, and batches the users' decoding together.
"""

from __future__ import annotations

import asyncio
import time

from common import HttpBackend, Session, arguments, escape, finish, show_calls, texts

from parrot_backend.client import semantic_function

APPS = [
    "a travel planner for river cruises",
    "a tutor who explains how clocks work",
    "a bakery's customer assistant",
    "a guide to bird watching",
    "a bridge inspector",
]


def make_app(i: int, prompt_tokens: int, max_tokens: int):
    system = escape(texts.system_prompt(100 + i, prompt_tokens, role=APPS[i % len(APPS)]))
    template = system + "\n\nUser: {{input:question}}\nAssistant: {{output:answer}}"

    def app(question):
        pass

    app.__name__ = f"app{i}"
    return semantic_function(template, max_tokens=max_tokens, temperature=0)(app)


async def main() -> None:
    ap = arguments(__doc__)
    ap.add_argument("--apps", type=int, default=3)
    ap.add_argument("--users", type=int, default=4, help="users per app")
    ap.add_argument("--prompt-tokens", type=int, default=800, help="system prompt size")
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args()
    apps = [make_app(i, args.prompt_tokens, args.max_tokens) for i in range(args.apps)]
    print(
        f"{args.apps} apps x {args.users} users, ~{args.prompt_tokens}-token system "
        f"prompts, {args.max_tokens} tokens per answer, all at once"
    )
    backend = HttpBackend(args.url, timeout_s=120)
    sessions, answers = [], []
    for a, app in enumerate(apps):
        for u in range(args.users):
            with Session(backend) as session:
                answers.append((a, u, app(texts.question(a * 100 + u))))
            sessions.append(session)

    async def wait(var) -> float:
        await var.aget()
        return time.time() - start

    start = time.time()
    done = await asyncio.gather(*(wait(v) for _, _, v in answers))
    took = time.time() - start
    for a in range(args.apps):
        mine = [t for (app, _, _), t in zip(answers, done, strict=True) if app == a]
        print(
            f"  app {a} ({APPS[a % len(APPS)]}): {len(mine)} users answered in "
            f"{min(mine):.1f}-{max(mine):.1f} s"
        )
    a, u, var = answers[0]
    print(
        f"\nall {len(answers)} users: {took:.1f} s; e.g. app 0 user 0: "
        f"{(await var.aget()).strip()[:160]!r}\n"
    )
    show_calls(args.url, [s.run_id for s in sessions], start)
    finish(backend, sessions)


if __name__ == "__main__":
    asyncio.run(main())
