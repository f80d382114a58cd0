"""Tenants and API keys."""

from __future__ import annotations

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError

from parrot_backend.store.base import StoreBase, tenant_record
from parrot_backend.store.columns import utcnow
from parrot_backend.store.errors import InvalidRequestError, NotFoundError
from parrot_backend.store.keys import hash_key, new_key
from parrot_backend.store.models import ApiKey, Tenant
from parrot_backend.store.records import TenantRecord


class TenantsMixin(StoreBase):
    """Create tenants, issue and check API keys."""

    def create_tenant(self, name: str) -> tuple[TenantRecord, str]:
        """Create a tenant with one API key; the plain key is returned here and never again."""
        key = new_key()
        try:
            with self._write() as s:
                tenant = Tenant(name=name, created_at=utcnow())
                s.add(tenant)
                s.flush()
                s.add(ApiKey(tenant_id=tenant.id, key_hash=hash_key(key), prefix=key[:12]))
                record = tenant_record(tenant)
        except IntegrityError:
            raise InvalidRequestError(f"tenant {name!r} already exists") from None
        return record, key

    def ensure_tenant(self, name: str) -> TenantRecord:
        """The tenant with this name, created (without a key) if missing."""
        with self._read() as s:
            found = s.scalar(select(Tenant).where(Tenant.name == name))
            if found is not None:
                return tenant_record(found)
        try:
            with self._write() as s:
                tenant = Tenant(name=name, created_at=utcnow())
                s.add(tenant)
                s.flush()
                return tenant_record(tenant)
        except IntegrityError:  # created concurrently by another process
            with self._read() as s:
                return tenant_record(s.scalars(select(Tenant).where(Tenant.name == name)).one())

    def get_tenant(self, tenant_id: int) -> TenantRecord:
        """A tenant by id."""
        with self._read() as s:
            tenant = s.get(Tenant, tenant_id)
            if tenant is None:
                raise NotFoundError(f"no tenant {tenant_id}")
            return tenant_record(tenant)

    def create_api_key(self, tenant_id: int) -> str:
        """Issue another key for a tenant; the plain key is returned once."""
        key = new_key()
        with self._write() as s:
            if s.get(Tenant, tenant_id) is None:
                raise NotFoundError(f"no tenant {tenant_id}")
            s.add(ApiKey(tenant_id=tenant_id, key_hash=hash_key(key), prefix=key[:12]))
        return key

    def tenant_for_key(self, key: str) -> TenantRecord | None:
        """The tenant owning an unrevoked key, or None."""
        with self._read() as s:
            tenant = s.scalar(
                select(Tenant)
                .join(ApiKey, ApiKey.tenant_id == Tenant.id)
                .where(ApiKey.key_hash == hash_key(key), ApiKey.revoked_at.is_(None))
            )
            return None if tenant is None else tenant_record(tenant)

    def revoke_api_key(self, key: str) -> bool:
        """Revoke a key; True when it was active."""
        with self._write() as s:
            result = s.execute(
                update(ApiKey)
                .where(ApiKey.key_hash == hash_key(key), ApiKey.revoked_at.is_(None))
                .values(revoked_at=utcnow())
            )
            return bool(result.rowcount)
