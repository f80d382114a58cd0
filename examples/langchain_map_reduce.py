"""Map-reduce summarisation with LangChain, plain and through `compile_chain`.

Start a server first (`make serve`), then:

    .venv/bin/python examples/langchain_map_reduce.py [--url http://127.0.0.1:8000]

The chain is ordinary LCEL: each document is summarised by the model (the map, in
parallel), then one call combines the summaries (the reduce). Run plainly, every LLM
step is its own request to the OpenAI-compatible route and the client waits for each
summary before it can send the reduce. Compiled, the whole chain is one program: one
request, the reduce starts on the server the moment its inputs exist, and the shared
instruction text is filled into the KV cache once for every map call. Both runs are
greedy, so they print the same summary.
"""

from __future__ import annotations

import argparse
import time
from operator import itemgetter

import httpx
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnableParallel
from langchain_parrot import ChatParrot, compile_chain

DOCUMENTS = [
    "Parrots are intelligent birds of the tropics. Many species can imitate human speech, "
    "and some use tools. They live in flocks and eat seeds, nuts and fruit.",
    "A river carries water from high ground to the sea. Over centuries it carves valleys, "
    "moves sediment and builds deltas where it meets the coast.",
    "Mechanical clocks keep time with a regulated release of energy: a weight or spring "
    "drives gears, and an escapement lets them advance in equal steps.",
    "Lanterns were lit with oil or candles for centuries before electric light. Sailors, "
    "miners and watchmen carried them to see at night.",
]
INSTRUCTIONS = (
    "You summarise documents for a busy reader. Keep only the main point, in "
    "one sentence, without a preamble."
)


def build(chat: ChatParrot):
    summarise = (
        ChatPromptTemplate.from_messages([("system", INSTRUCTIONS), ("human", "Document:\n{doc}")])
        | chat
        | StrOutputParser()
    )
    mapped = RunnableParallel(
        {f"s{i}": itemgetter(f"doc{i}") | summarise for i in range(len(DOCUMENTS))}
    )
    joined = "\n".join(f"- {{s{i}}}" for i in range(len(DOCUMENTS)))
    reduce = ChatPromptTemplate.from_messages(
        [("system", INSTRUCTIONS), ("human", "Combine these summaries:\n" + joined)]
    )
    return mapped | reduce | chat | StrOutputParser()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--model", help="model name (default: the first the server serves)")
    args = ap.parse_args()
    model = args.model or httpx.get(f"{args.url}/v1/models").json()["data"][0]["id"]
    sent = []
    client = httpx.Client(event_hooks={"request": [sent.append]})
    chat = ChatParrot(
        base_url=args.url,
        model=model,
        temperature=0,
        max_tokens=args.max_tokens,
        http_client=client,
    )
    chain = build(chat)
    inputs = {f"doc{i}": d for i, d in enumerate(DOCUMENTS)}
    print(f"map-reduce over {len(DOCUMENTS)} documents, greedy, {args.max_tokens} tokens per step")
    start = time.perf_counter()
    plain = chain.invoke(inputs)
    plain_s = time.perf_counter() - start
    print(f"\nplain chain: {len(sent)} requests, {plain_s:.1f} s\n  {plain.strip()}")
    compiled = compile_chain(chain)
    start = time.perf_counter()
    fast = compiled.invoke(inputs)
    fast_s = time.perf_counter() - start
    print(
        f"\ncompiled chain: {compiled.last_requests} request(s), {fast_s:.1f} s\n  {fast.strip()}"
    )
    print(f"\nsame output: {fast == plain}; {plain_s / fast_s:.2f}x the plain chain's speed")


if __name__ == "__main__":
    main()
