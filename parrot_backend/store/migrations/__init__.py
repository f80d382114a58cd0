"""Alembic migrations of the store; configured from code by :mod:`parrot_backend.store.schema`."""
