"""Column types and status vocabularies shared by the models and the repository."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import JSON, DateTime, Text
from sqlalchemy.engine import Dialect
from sqlalchemy.types import TypeDecorator

# Plain JSON, not JSONB, on PostgreSQL: JSONB reorders object keys, and key order is
# meaningful in programs (a call's outputs are generated in the order they are listed).
JSONType = JSON()

RUN_STATUSES = ("pending", "running", "done", "failed", "cancelled")
RUN_UNFINISHED = ("pending", "running")
RUN_FINISHED = ("done", "failed", "cancelled")
VARIABLE_STATUSES = ("pending", "ready", "failed")
CALL_STATUSES = ("pending", "claimed", "running", "done", "failed", "cancelled")
CALL_HELD = ("claimed", "running")
OBJECTIVES = ("latency", "throughput")


def utcnow() -> datetime:
    """The current time, timezone-aware UTC (the only kind of datetime the store hands out)."""
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """A timestamp that is always UTC-aware in Python.

    SQLite has no timezone-aware type, so values are stored there as naive UTC text in one
    fixed format; that keeps ``<`` comparisons (lease expiry, retention) correct as text.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            # Naive values are taken as UTC rather than local time: the store never makes them.
            value = value.replace(tzinfo=UTC)
        value = value.astimezone(UTC)
        if dialect.name == "sqlite":
            return value.replace(tzinfo=None)
        return value

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


_NUL_MARK = "\x01parrot:nul\x01"  # starts a PostgreSQL value whose NULs are escaped


class ValueText(TypeDecorator[str]):
    """Text that may hold NUL: a generated value can (a model may emit the NUL byte).

    PostgreSQL text cannot store NUL, so there a value holding one (or starting with the
    marker) is stored as the marker followed by the value with `\\` and NUL escaped as
    `\\\\` and `\\0`; reading reverses it. SQLite stores every value as it is. Request
    text never holds NUL (the API refuses it); this is for what the engine generates.
    """

    impl = Text
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Dialect) -> str | None:
        if value is None or dialect.name == "sqlite":
            return value
        if "\x00" not in value and not value.startswith(_NUL_MARK):
            return value
        return _NUL_MARK + value.replace("\\", "\\\\").replace("\x00", "\\0")

    def process_result_value(self, value: Any, dialect: Dialect) -> str | None:
        if value is None or dialect.name == "sqlite" or not value.startswith(_NUL_MARK):
            return value
        return _UNESCAPE.sub(_unescape, value[len(_NUL_MARK) :])


_UNESCAPE = re.compile(r"\\(.)", re.S)


def _unescape(m: re.Match[str]) -> str:
    return "\x00" if m.group(1) == "0" else m.group(1)
