"""What text a program, a run or a value may hold: what both stores keep as given.

PostgreSQL text cannot hold NUL, and no UTF-8 store can hold a lone surrogate (JSON
admits `"\\ud800"`). Such text is refused where it enters (a 400 naming the field), so
it never reaches the store: before, it gave 500s, some of them on every later read of
the tenant's runs or workflows. Names are bounded by the store's name columns.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, model_validator

MAX_NAME_LENGTH = 200  # the store's VARCHAR(200) name columns (calls, variables, workflows)


def text_problem(value: str) -> str | None:
    """Why `value` cannot be stored as it is, or None."""
    if "\x00" in value:
        return "contains a NUL character (U+0000)"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(value[exc.start])
        return f"contains a lone surrogate (U+{code:04X}): send well-formed Unicode"
    return None


def check_texts(data: Any, path: str = "") -> None:
    """Raise ValueError naming the first string (key or value) in `data` that cannot be
    stored. Walks dicts and lists; other values are left to their own validation."""
    stack: list[tuple[Any, str]] = [(data, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            problem = text_problem(item)
            if problem is not None:
                raise ValueError(f"{where or 'a string'} {problem}")
        elif isinstance(item, dict):
            for key, value in item.items():
                if isinstance(key, str):
                    problem = text_problem(key)
                    if problem is not None:
                        raise ValueError(f"a key of {where or 'the body'} {problem}")
                stack.append((value, f"{where}.{key}" if where else str(key)))
        elif isinstance(item, list):
            stack.extend((value, f"{where}[{i}]") for i, value in enumerate(item))


class StorableModel(BaseModel):
    """Base of request bodies: every string in the body, keys too, must be storable
    (checked once on the raw body, before any field is validated: a 400 naming it)."""

    @model_validator(mode="before")
    @classmethod
    def _storable_text(cls, data: Any) -> Any:
        check_texts(data)
        return data
