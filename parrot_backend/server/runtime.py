"""The native runtime: store + manager + persister, and recovery of unfinished runs.

`NativeRuntime` is what the native API routes use. It owns the `Manager` (runs on the
engines) and the `StorePersister` (every manager event committed before it is visible),
maps tenant names (what auth resolves) to store tenant ids, derives prefix salts, and on
start resumes the runs the store holds as unfinished: ready variables are passed to the
manager as known values (never recomputed), calls not done run again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import uuid
from collections.abc import Mapping
from typing import Any

from parrot_backend.contract.engine import EngineClient
from parrot_backend.manager.manager import Manager, ManagerConfig
from parrot_backend.program import ProgramError, ProgramSpec, RunSpec
from parrot_backend.store import NotFoundError, RunRecord, Store, VariableRecord

from .auth import tenant_salt
from .notify import Notifier
from .persist import RunMeta, StorePersister

log = logging.getLogger(__name__)


def default_worker() -> str:
    """A worker id stable across restarts on one host: a restarted server releases the
    claims its previous life held without waiting for their leases."""
    return f"serve@{socket.gethostname()}"


class NativeRuntime:
    """Runs programs for tenants, persisted in `store`. Start it on the serving loop."""

    def __init__(
        self,
        store: Store,
        engines: Mapping[str, EngineClient],
        *,
        worker: str | None = None,
        salt_secret: bytes | None = None,
        manager_config: ManagerConfig | None = None,
        keep_finished_s: float = 60.0,
        # token events reach the store (and SSE readers) in batches this often: 0.05 s
        # cost ~0.14 s more CPU per 165-token run than 0.1 s (writes and the streams'
        # reads of each batch), which a CPU server takes from its engine's steps
        flush_interval_s: float = 0.1,
        persist: bool = True,
        owner_lease_s: float = 30.0,
    ) -> None:
        self.store = store
        self.worker = worker or default_worker()
        self.salt_secret = salt_secret or uuid.uuid4().bytes
        self.notifier = Notifier()
        self.persister = StorePersister(
            store,
            self.worker,
            self.notifier,
            flush_interval_s=flush_interval_s,
            owner_lease_s=owner_lease_s,
        )
        # several servers may share one database: each runs the runs it owns, renews its
        # lease on them, and adopts the runs of a server whose lease ran out
        self.owner_lease_s = owner_lease_s
        self._ownership: asyncio.Task[None] | None = None
        listeners: list[Any] = [self.persister, self] if persist else [self]
        self.manager = Manager(engines, config=manager_config, listeners=listeners)
        self.keep_finished_s = keep_finished_s
        self._tenants: dict[str, int] = {}
        # reads of a live run's variables in flight: (tenant id, run id) -> (the run's
        # last event when the read began, the read)
        self._reads: dict[tuple[int, str], tuple[int, asyncio.Future[dict]]] = {}
        self._forget_tasks: set[asyncio.Task[None]] = set()
        self.recovered: list[str] = []

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Start the manager and the persister, then resume unfinished runs."""
        self.persister.start()
        await self.manager.start()
        self.recovered = await self.recover()
        self._ownership = asyncio.create_task(self._keep_ownership(), name="parrot-owner")

    async def stop(self) -> None:
        """Persist what is buffered and stop. Runs still going stay unfinished in the
        store (the manager's cancellation on stop is not persisted): the next start
        resumes them."""
        if self._ownership is not None:
            self._ownership.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ownership
        await self.persister.stop()
        await self.manager.stop()
        for task in list(self._forget_tasks):
            task.cancel()

    # ------------------------------------------------------------------ tenants
    async def tenant_id(self, tenant: str) -> int:
        """The store id of a tenant name (created on first use)."""
        found = self._tenants.get(tenant)
        if found is None:
            record = await asyncio.to_thread(self.store.ensure_tenant, tenant)
            found = self._tenants[tenant] = record.id
        return found

    def salt(self, tenant: str) -> str:
        """The server-derived prefix salt of a tenant (never chosen by a client)."""
        return tenant_salt(self.salt_secret, tenant)

    async def key_lookup(self, key: str) -> str | None:
        """Bearer key -> tenant name, from the store's API keys."""
        record = await asyncio.to_thread(self.store.tenant_for_key, key)
        return None if record is None else record.name

    # ------------------------------------------------------------------ runs
    async def create_run(
        self,
        tenant: str,
        spec: RunSpec,
        *,
        workflow_id: int | None = None,
        replay_of: str | None = None,
    ) -> str:
        """Create and start a run; returns its id once it is committed."""
        tenant_id = await self.tenant_id(tenant)
        run_id = uuid.uuid4().hex
        self.persister.expect(run_id, RunMeta(tenant_id, workflow_id, replay_of))
        try:
            await self.manager.create_run(
                spec, tenant=tenant, salt=self.salt(tenant), run_id=run_id
            )
        except BaseException:
            self.persister.drop(run_id)
            raise
        return run_id

    async def owned(self, tenant: str, run_id: str) -> RunRecord:
        """The run's summary if `tenant` owns it; NotFoundError otherwise (also for
        another tenant's run, which must look exactly like a missing one)."""
        tenant_id = await self.tenant_id(tenant)
        detail = await asyncio.to_thread(self.store.get_run, tenant_id, run_id)
        return detail.run

    async def read_variable(self, tenant_id: int, run_id: str, name: str) -> VariableRecord:
        """A variable as the store has it. For a run this manager holds, one read of all
        its variables serves every asker that needs no event the run logged after the read
        began (events are logged once committed): a fan-out's long polls, answered
        together, read once, not once each (8 reads on threads at once took ~17 ms)."""
        run = self.manager.runs.get(run_id)
        if run is None:
            return await asyncio.to_thread(self.store.get_variable, tenant_id, run_id, name)
        key, seq = (tenant_id, run_id), len(run.log.events)
        read = self._reads.get(key)
        if read is None or read[0] < seq:
            task = asyncio.ensure_future(
                asyncio.to_thread(self.store.get_variables, tenant_id, run_id)
            )
            read = self._reads[key] = (seq, task)

            def done(t: asyncio.Future[dict], key=key, read=read) -> None:
                if self._reads.get(key) is read:
                    del self._reads[key]
                if not t.cancelled():
                    t.exception()  # (retrieved: every asker may have gone)

            task.add_done_callback(done)
        records = await asyncio.shield(read[1])  # an asker that leaves ends no one's read
        try:
            return records[name]
        except KeyError:
            raise NotFoundError(f"run {run_id!r} has no variable {name!r}") from None

    def live(self, tenant: str, run_id: str) -> bool:
        """Whether the manager holds this tenant's run in memory."""
        run = self.manager.runs.get(run_id)
        return run is not None and run.tenant == tenant

    # ------------------------------------------------------------------ listener
    async def on_event(self, run_id: str, type: str, payload: dict[str, Any]) -> None:
        """Second listener (after the persister): forget finished runs after a while,
        so memory stays bounded; the store answers for them from then on."""
        if type == "run_finished":
            loop = asyncio.get_running_loop()
            loop.call_later(self.keep_finished_s, self._schedule_forget, run_id)

    def _schedule_forget(self, run_id: str) -> None:
        task = asyncio.create_task(self._forget(run_id))
        self._forget_tasks.add(task)
        task.add_done_callback(self._forget_tasks.discard)

    async def _forget(self, run_id: str) -> None:
        run = self.manager.runs.get(run_id)
        if run is not None and run.state != "running":
            await self.manager.forget(run_id)
            self.persister.drop(run_id)

    # ------------------------------------------------------------------ recovery
    async def recover(self, *, at_start: bool = True) -> list[str]:
        """Resume the unfinished runs in the store that no other live server owns (each
        one claimed first); returns their ids."""
        st = self.store
        if at_start:  # what a previous life of this server held is free again
            await asyncio.to_thread(st.release_worker_claims, self.worker)
        resumed = []
        for unfinished in await asyncio.to_thread(st.unfinished_runs):
            run_id = unfinished.run.id
            if run_id in self.manager.runs:
                continue
            # another live server owns it: it is theirs (we adopt it if their lease lapses)
            if not await asyncio.to_thread(
                st.claim_run, run_id, self.worker, lease_s=self.owner_lease_s
            ):
                continue
            try:
                await self._resume(unfinished.run)
                resumed.append(run_id)
            except (ProgramError, ValueError, NotFoundError) as exc:
                log.error("run %s cannot be resumed: %s", run_id, exc)
                self.persister.drop(run_id)
                await asyncio.to_thread(
                    st.set_run_status, run_id, "failed", error=f"not resumable: {exc}"
                )
        if resumed:
            log.info("resumed %d unfinished run(s)", len(resumed))
        return resumed

    async def _keep_ownership(self) -> None:
        """Renew the lease on our runs; adopt runs whose owner stopped renewing (it died):
        their ready values are kept and their unfinished calls run here."""
        while True:
            await asyncio.sleep(self.owner_lease_s / 3)
            try:
                await asyncio.to_thread(
                    self.store.renew_runs, self.worker, lease_s=self.owner_lease_s
                )
                orphans = await asyncio.to_thread(self.store.adoptable_runs, self.worker)
                if any(r not in self.manager.runs for r in orphans):
                    await asyncio.to_thread(self.store.release_expired_claims)
                    adopted = await self.recover(at_start=False)
                    if adopted:
                        log.info("adopted %d run(s) of a server that stopped", len(adopted))
            except Exception:  # a database hiccup: try again next round
                log.exception("renewing or adopting runs failed")

    async def _resume(self, record: RunRecord) -> None:
        tenant = await asyncio.to_thread(self.store.get_tenant, record.tenant_id)
        self._tenants[tenant.name] = tenant.id
        # calls whose end was lost after their outputs were committed: done, not run again
        await asyncio.to_thread(self.store.settle_calls, record.id, self.worker)
        detail = await asyncio.to_thread(self.store.get_run, tenant.id, record.id)
        ready = {n: v for n, v in detail.variables.items() if v.status == "ready"}
        inputs = {n: v.value or "" for n, v in ready.items() if v.producer_call is None}
        known = {n: v.value or "" for n, v in ready.items() if v.producer_call is not None}
        spec = RunSpec(
            program=ProgramSpec.model_validate(detail.program),
            inputs=inputs,
            outputs=dict(record.objectives),
            open=record.open,
        )
        meta = RunMeta(
            tenant.id,
            record.workflow_id,
            record.replay_of,
            resumed=True,
            program=dict(detail.program),
            started=record.status == "running",
        )
        meta.set_calls(detail.calls)
        self.persister.expect(record.id, meta)
        await self.manager.create_run(
            spec,
            tenant=tenant.name,
            salt=self.salt(tenant.name),
            run_id=record.id,
            known=known,
            waits=record.waits,
            stated=record.stated,
        )
