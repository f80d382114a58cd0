"""Errors raised by the store; every one is a :class:`StoreError`."""

from __future__ import annotations


class StoreError(Exception):
    """Base class: the database cannot be used as asked (bad URL, bad file, bad schema...)."""


class DatabaseUrlError(StoreError):
    """The database URL cannot be parsed, names an unsupported backend, or cannot connect."""


class ForeignDatabaseError(StoreError):
    """The database is not ours (a non-SQLite file, or tables without our version marker)."""


class SchemaOutdatedError(StoreError):
    """The schema is older than the code and upgrading was not allowed."""


class SchemaTooNewError(StoreError):
    """The schema carries a revision this code does not know (written by newer code)."""


class NotFoundError(StoreError):
    """A tenant, workflow, run, variable or call does not exist (or belongs to another tenant)."""


class InvalidRequestError(StoreError):
    """The data given to a store operation is inconsistent (e.g. a variable with two producers)."""
