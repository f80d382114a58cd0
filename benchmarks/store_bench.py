"""Store write throughput: events/s appended in batches (and one by one, for contrast).

    .venv/bin/python benchmarks/store_bench.py                 # SQLite file in a temp dir
    .venv/bin/python benchmarks/store_bench.py --url postgresql+psycopg://postgres@127.0.0.1/test

Each batch carries one token-delta event per active run, repeated, like a flush of the
engine loop's buffered deltas; every batch is one committed transaction. On PostgreSQL
the benchmark works in a scratch schema that it drops afterwards.
"""

from __future__ import annotations

import argparse
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import create_engine, text
from sqlalchemy.engine import URL, make_url

from parrot_backend.store import Store


@contextmanager
def scratch(url: str | None, tmp: str) -> Iterator[URL]:
    """A fresh SQLite file, or a throwaway schema on the given PostgreSQL database."""
    if url is None:
        yield make_url(f"sqlite:///{Path(tmp) / 'bench.db'}")
        return
    base = make_url(url)
    name = f"parrot_bench_{uuid.uuid4().hex[:10]}"
    admin = create_engine(base)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{name}"'))
    try:
        yield base.update_query_dict({"options": f"-csearch_path={name}"})
    finally:
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{name}" CASCADE'))
        admin.dispose()


def bench_batched(store: Store, runs: list[str], events: int, batch: int) -> float:
    """Append ``events`` events in batches of ``batch`` spread over ``runs``; events/s."""
    done = 0
    start = time.perf_counter()
    while done < events:
        n = min(batch, events - done)
        store.append_events(
            [
                (runs[(done + i) % len(runs)], "token", {"text": "tok", "i": done + i})
                for i in range(n)
            ]
        )
        done += n
    return events / (time.perf_counter() - start)


def bench_single(store: Store, run: str, events: int) -> float:
    """Append ``events`` events one transaction each; events/s."""
    start = time.perf_counter()
    for i in range(events):
        store.append_event(run, "token", {"text": "tok", "i": i})
    return events / (time.perf_counter() - start)


def main() -> None:
    """Parse arguments, run the measurements, print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="database URL (default: a fresh SQLite file)")
    parser.add_argument("--events", type=int, default=50_000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--runs", type=int, default=32)
    parser.add_argument("--single", type=int, default=2_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, scratch(args.url, tmp) as url:
        with Store(url) as store:
            tenant, _ = store.create_tenant(f"bench-{uuid.uuid4().hex[:8]}")
            calls = [{"name": "c", "inputs": ["q"], "outputs": ["a"]}]
            runs = [
                store.create_run(tenant.id, {}, calls, {"q": "?"}).run.id for _ in range(args.runs)
            ]
            bench_batched(store, runs, 2_000, args.batch)  # warm-up: caches, pool, WAL
            batched = bench_batched(store, runs, args.events, args.batch)
            single = bench_single(store, runs[0], args.single)
            print(f"backend: {store.dialect}")
            print(
                f"batched: {batched:,.0f} events/s  ({args.events} events, batch {args.batch},"
                f" {args.runs} runs, one transaction per batch)"
            )
            print(f"single:  {single:,.0f} events/s  ({args.single} events, one transaction each)")


if __name__ == "__main__":
    main()
