"""Workflows: named programs, versioned per tenant."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError

from parrot_backend.store.base import StoreBase, workflow_record
from parrot_backend.store.columns import utcnow
from parrot_backend.store.errors import NotFoundError, StoreError
from parrot_backend.store.models import Tenant, Workflow
from parrot_backend.store.records import WorkflowRecord

_RETRIES = 5


class WorkflowsMixin(StoreBase):
    """Register, fetch and list workflows."""

    def register_workflow(
        self, tenant_id: int, name: str, program: Mapping[str, Any], *, public: bool = False
    ) -> WorkflowRecord:
        """Store a program under ``name`` as the next version (1, 2, ...)."""
        for _ in range(_RETRIES):
            try:
                with self._write() as s:
                    # one registration of this tenant's workflows at a time: concurrent
                    # ones each read the same latest version and all but one collided
                    # (PostgreSQL: 8 of 40 at once ran out of retries). SQLite writes one
                    # transaction at a time already and ignores the row lock.
                    s.execute(select(Tenant.id).where(Tenant.id == tenant_id).with_for_update())
                    latest = s.scalar(
                        select(func.max(Workflow.version)).where(
                            Workflow.tenant_id == tenant_id, Workflow.name == name
                        )
                    )
                    wf = Workflow(
                        tenant_id=tenant_id,
                        name=name,
                        version=(latest or 0) + 1,
                        program=dict(program),
                        public=public,
                        created_at=utcnow(),
                    )
                    s.add(wf)
                    s.flush()
                    return workflow_record(wf)
            except IntegrityError:
                # Another writer took this version number (PostgreSQL); take the next one.
                continue
        raise StoreError(f"could not register workflow {name!r}: too much contention")

    def get_workflow(self, tenant_id: int, name: str, version: int | None = None) -> WorkflowRecord:
        """A version of a workflow, the latest when ``version`` is None."""
        query = select(Workflow).where(Workflow.tenant_id == tenant_id, Workflow.name == name)
        if version is None:
            query = query.order_by(Workflow.version.desc()).limit(1)
        else:
            query = query.where(Workflow.version == version)
        with self._read() as s:
            wf = s.scalar(query)
            if wf is None:
                which = "any version" if version is None else f"version {version}"
                raise NotFoundError(f"no workflow {name!r} ({which})")
            return workflow_record(wf)

    def workflow_by_id(self, tenant_id: int, workflow_id: int) -> WorkflowRecord:
        """The workflow version stored under ``workflow_id`` (a run's `workflow_id`)."""
        with self._read() as s:
            wf = s.get(Workflow, workflow_id)
            if wf is None or wf.tenant_id != tenant_id:
                raise NotFoundError(f"no workflow {workflow_id}")
            return workflow_record(wf)

    def list_workflows(self, tenant_id: int, name: str | None = None) -> list[WorkflowRecord]:
        """All workflow versions of a tenant (or of one name), by name then version."""
        query = select(Workflow).where(Workflow.tenant_id == tenant_id)
        if name is not None:
            query = query.where(Workflow.name == name)
        with self._read() as s:
            rows = s.scalars(query.order_by(Workflow.name, Workflow.version))
            return [workflow_record(w) for w in rows]
