"""A worker killed with SIGKILL by test_crash.py: args URL RUN_ID.

It claims the run's call, commits 5 batches of 10 events, then appends one more batch
inside a transaction it never commits, prints "open" and waits to be killed.
"""

from __future__ import annotations

import sys
import time

from parrot_backend.store import Store
from parrot_backend.store.events import append_in


def main() -> None:
    """Do the committed and the uncommitted writes, then hang."""
    url, run_id = sys.argv[1], sys.argv[2]
    store = Store(url, upgrade=False)
    (claimed,) = store.claim_calls("doomed", lease_s=3600, run_id=run_id)
    store.mark_call_started(claimed.call.id, "doomed", engine="e0")
    for b in range(5):
        store.append_events([(run_id, "token", {"b": b, "i": i}) for i in range(10)])
    with store._write() as session:
        append_in(session, [(run_id, "token", {"uncommitted": i}) for i in range(10)])
        session.flush()
        print("open", flush=True)
        time.sleep(600)


if __name__ == "__main__":
    main()
