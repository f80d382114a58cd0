"""A claimer process for the multi-process claim test: args URL WORKER GO_FILE OUT_FILE."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from parrot_backend.store import Store


def main() -> None:
    """Claim and finish calls until none is left; write the claimed call ids as JSON."""
    url, worker, go, out = sys.argv[1], sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])
    store = Store(url, upgrade=False)
    store.last_event_seq  # noqa: B018 - touch the engine before the race
    Path(f"{out}.ready").touch()
    while not go.exists():
        time.sleep(0.005)
    seen: list[int] = []
    idle = 0
    while idle < 3:
        claimed = store.claim_calls(worker, limit=1, lease_s=60)
        if not claimed:
            idle += 1
            time.sleep(0.01)
            continue
        idle = 0
        for c in claimed:
            seen.append(c.call.id)
            # A little work per call, so that the two processes interleave.
            time.sleep(0.004)
            if not store.finish_call(c.call.id, worker, {c.call.outputs[0]: worker}).accepted:
                sys.exit(f"{worker} lost call {c.call.id}")
    out.write_text(json.dumps(seen))
    store.close()


if __name__ == "__main__":
    main()
