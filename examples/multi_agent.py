"""A MetaGPT-style software team: an architect writes a design; engineers each write one
file from the whole design; reviewers read each file; engineers revise; several rounds.

Start a server first (`parrot-backend serve`), then:

    .venv/bin/python examples/multi_agent.py [--url URL] [--engineers 3] [--rounds 1]

The design is generated at run time and every engineer's prompt begins with it: a shared
prefix that no client-side cache could know in advance. Submitted as one program, the
server fills the design into the KV cache once, when the architect finishes, and forks
every engineer's context from it; reviews and revisions start on the server as soon as the
code they read exists, with no round trip back to the client.
"""

from __future__ import annotations

import time

from common import HttpBackend, Session, arguments, finish, show_calls

from parrot_backend.client import semantic_function

TASK = (
    "a command-line to-do list in Python: add, list and complete tasks, saved to a JSON "
    "file in the user's home folder"
)
FILES = [
    "storage.py: load and save the task list",
    "tasks.py: the Task class and its rules",
    "cli.py: the argparse commands",
    "test_tasks.py: pytest tests for tasks.py",
    "README.md: how to install and use it",
]


def main() -> None:
    ap = arguments(__doc__)
    ap.add_argument("--engineers", type=int, default=3, help=f"engineers (<= {len(FILES)})")
    ap.add_argument("--rounds", type=int, default=1, help="review-and-revise rounds")
    ap.add_argument("--design-tokens", type=int, default=160)
    ap.add_argument("--code-tokens", type=int, default=48)
    ap.add_argument("--review-tokens", type=int, default=24)
    args = ap.parse_args()

    @semantic_function(max_tokens=args.design_tokens, temperature=0)
    def architect(task):
        """You are the software architect of a small team.
        Task: {{input:task}}
        Write the design: the modules, their functions and how they talk to each other.
        Design:
        {{output:design}}"""

    @semantic_function(max_tokens=args.code_tokens, temperature=0)
    def engineer(task, design, file):
        """You are an engineer on a small team. Task: {{input:task}}
        The architect's design:
        {{input:design}}
        Your file: {{input:file}}
        Write the complete code of this file only.
        Code:
        {{output:code}}"""

    @semantic_function(max_tokens=args.review_tokens, temperature=0)
    def reviewer(design, code):
        """You review code against the design.
        Design:
        {{input:design}}
        Code:
        {{input:code}}
        The most important problem, in one sentence: {{output:review}}"""

    @semantic_function(max_tokens=args.code_tokens, temperature=0)
    def revise(task, design, file, draft, review):
        """You are an engineer on a small team. Task: {{input:task}}
        The architect's design:
        {{input:design}}
        Your file: {{input:file}}
        Your code:
        {{input:draft}}
        Review: {{input:review}}
        The corrected code:
        {{output:code}}"""

    files = FILES[: args.engineers]
    calls = 1 + len(files) * (1 + 2 * args.rounds)
    print(
        f"software team: 1 architect, {len(files)} engineers, {args.rounds} review round(s)"
        f" = {calls} calls in one program"
    )
    backend = HttpBackend(args.url, timeout_s=120)
    start = time.time()
    with Session(backend) as session:
        design = architect(TASK)
        code = [engineer(TASK, design, f) for f in files]
        for _ in range(args.rounds):
            reviews = [reviewer(design, c) for c in code]
            rows = zip(files, code, reviews, strict=True)
            code = [revise(TASK, design, f, c, r) for f, c, r in rows]
        first = design.get()
        t_design = time.time() - start
        final = [c.get() for c in code]
    took = time.time() - start
    print(f"\ndesign after {t_design:.1f} s:\n  " + first.strip()[:300].replace("\n", "\n  "))
    for f, c in zip(files, final, strict=True):
        print(f"\n{f.split(':')[0]} (final):\n  " + c.strip()[:200].replace("\n", "\n  "))
    print(f"\nwhole team: {took:.1f} s for {calls} calls\n")
    show_calls(args.url, [session.run_id], start)
    finish(backend, [session])


if __name__ == "__main__":
    main()
