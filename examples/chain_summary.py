"""Chain summarisation of a long document: each step reads the summary so far and the next
part of the document, and writes an updated summary.

Start a server first (`parrot-backend serve`), then:

    .venv/bin/python examples/chain_summary.py [--url http://127.0.0.1:8000] [--parts 4]

Every step depends on the one before, so a request-level client waits for each summary to
come back before it can send the next request (one network round trip per step, and the
scheduler sees one unrelated request at a time). Here the whole chain is built with
`@semantic_function` and submitted as one program: the server starts each step the moment
its input exists, and knows the last summary is what the user waits for, so every step of
the chain is scheduled for latency.
"""

from __future__ import annotations

import time

from common import HttpBackend, Session, arguments, finish, show_calls, texts

from parrot_backend.client import semantic_function


def main() -> None:
    ap = arguments(__doc__)
    ap.add_argument("--parts", type=int, default=4, help="document parts (chain steps)")
    ap.add_argument("--part-tokens", type=int, default=200, help="tokens per part")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens per summary")
    args = ap.parse_args()

    @semantic_function(max_tokens=args.max_tokens, temperature=0)
    def summarise(previous, part):
        """You keep a running summary of a long document for a busy reader.
        Summary so far: {{input:previous}}
        Next part of the document:
        {{input:part}}
        Updated summary, two sentences: {{output:summary}}"""

    parts = texts.chunks(seed=7, n_chunks=args.parts, chunk_tokens=args.part_tokens)
    print(
        f"chain summary: {args.parts} parts of ~{args.part_tokens} tokens, "
        f"{args.max_tokens} tokens per step, greedy"
    )
    backend = HttpBackend(args.url, timeout_s=120)
    start = time.time()
    with Session(backend) as session:
        summary = "(nothing yet)"
        for part in parts:
            summary = summarise(summary, part)  # a handle: nothing runs yet
        final = summary.get()  # submits the whole chain as one run, waits for the end
    took = time.time() - start
    print(
        f"\nfinal summary ({took:.1f} s, one request for {args.parts} dependent calls):\n"
        f"  {final.strip()}\n"
    )
    show_calls(args.url, [session.run_id], start)
    finish(backend, [session])


if __name__ == "__main__":
    main()
