"""A worker killed with SIGKILL mid-transaction: committed state survives, the rest is gone,
and its call can be claimed again (at-least-once) without losing ready variables."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from sqlalchemy.engine import URL
from store_helpers import chain_calls, url_text

from parrot_backend.store import Store

CRASHER = Path(__file__).with_name("crasher_proc.py")


def test_sigkill_mid_transaction(store: Store, tenant: int, db_url: URL) -> None:
    run = store.create_run(tenant, {}, chain_calls(2), {"x0": "a"}).run.id
    proc = subprocess.Popen(
        [sys.executable, str(CRASHER), url_text(db_url), run], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "open"
    finally:
        proc.kill()  # SIGKILL: no cleanup, no rollback from the client side
        proc.wait(timeout=30)
    with Store(db_url, upgrade=False) as after:  # a "restarted" process
        events = after.read_events(tenant, run, limit=1000)
        assert [e.seq for e in events] == list(range(1, 51))
        assert all("uncommitted" not in e.payload for e in events)
        (resume,) = after.unfinished_runs()
        assert resume.ready == {"x0": "a"}
        (held,) = [c for c in resume.calls if c.idx == 0]
        assert (held.status, held.claimed_by, held.engine) == ("running", "doomed", "e0")
        assert after.claim_calls("new") == []  # its lease is still valid
        assert after.release_worker_claims("doomed") == 1
        (again,) = after.claim_calls("new")
        assert again.call.idx == 0 and again.call.attempts == 2
        assert after.finish_call(again.call.id, "new", {"x1": "b"}).accepted
        assert after.append_event(run, "next") == 51  # the log continues without a gap
        if after.dialect == "sqlite":
            with after.engine.connect() as conn:
                assert conn.exec_driver_sql("PRAGMA integrity_check").scalar() == "ok"
