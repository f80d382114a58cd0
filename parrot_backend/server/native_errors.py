"""Client errors of the native API: program, manager and store exceptions -> 4xx."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from parrot_backend.manager.runs import InputAlreadySet, RunClosedError, RunNotFound, TenantBusy
from parrot_backend.program import ProgramError, TemplateError
from parrot_backend.store import InvalidRequestError, NotFoundError

from .errors import APIError
from .native_chat import ChatCallError

TENANT_RETRY_AFTER_S = 1  # a tenant over its share waits for its own calls to finish


def not_found(run_id: str) -> APIError:
    """The same answer for a missing run and another tenant's run."""
    return APIError(404, f"no run {run_id!r}", code="run_not_found")


@contextlib.contextmanager
def client_errors(run_id: str | None = None) -> Iterator[None]:
    """Turn the exceptions bad input causes into 4xx answers naming the problem."""
    try:
        yield
    except (RunNotFound, NotFoundError) as exc:
        if run_id is not None and isinstance(exc, RunNotFound):
            raise not_found(run_id) from None
        raise APIError(404, str(exc), code="not_found") from None
    except RunClosedError as exc:
        raise APIError(409, str(exc), code="run_closed") from None
    except InputAlreadySet as exc:
        raise APIError(409, str(exc), code="already_set") from None
    except TemplateError as exc:
        raise APIError(400, str(exc), code="template_error") from None
    except ChatCallError as exc:
        raise APIError(400, str(exc), code="chat_call_error") from None
    except ProgramError as exc:
        raise APIError(400, str(exc), code="program_error") from None
    except InvalidRequestError as exc:
        raise APIError(400, str(exc), code="invalid_request") from None
    except TenantBusy as exc:
        raise APIError(
            429, str(exc), code="tenant_busy", headers={"Retry-After": str(TENANT_RETRY_AFTER_S)}
        ) from None
