"""The web page at `/ui`: run a program, watch its DAG and tokens live, replay past runs.

Plain HTML, JS and CSS in `static/` (shipped in the wheel as package data; nothing is
built at run time). The page is open (it holds no data and asks for a key when auth is
on); every request it makes goes through the API and its auth like any client's.

`EventSource` cannot send an Authorization header, so the page first asks
`POST /v1/runs/{id}/events/grant` (authenticated with the key in a header, like any API
call) for an *events grant*: an HMAC-signed cookie naming the tenant and the run, valid
for `auth.GRANT_TTL_S` seconds, `HttpOnly` (no script reads it), `SameSite=Strict` (no
other site makes the browser send it) and with `Path` set to that run's events route (the
browser sends it nowhere else, and the server accepts it nowhere else). The key itself
never appears in a URL, so it never lands in access logs or browser history.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request, Response
from fastapi.responses import FileResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles

from .auth import GRANT_COOKIE, GRANT_TTL_S, mint_events_grant
from .native_api import RuntimeDep, TenantDep, owned
from .native_schemas import RunIdPath
from .state import StateDep

STATIC_DIR = Path(__file__).parent / "static"

# What the page may load and talk to: only this origin, no inline script (model output is
# untrusted text; the page renders it with textContent, and the policy is a second guard).
_PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}

router = APIRouter()


@router.get("/", include_in_schema=False)
async def root() -> RedirectResponse:
    """The root leads to the page."""
    return RedirectResponse("/ui", status_code=307)


@router.api_route("/ui", methods=["GET", "HEAD"], include_in_schema=False)
async def page() -> FileResponse:
    """The page itself (its scripts and styles are under /ui/static/)."""
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html", headers=_PAGE_HEADERS)


@router.post(
    "/v1/runs/{run_id}/events/grant",
    status_code=204,
    tags=["native"],
    responses={204: {"description": "the grant is set as a cookie"}},
)
async def events_grant(
    run_id: RunIdPath, request: Request, rt: RuntimeDep, tenant: TenantDep, state: StateDep
) -> Response:
    """Let this browser open the run's event stream without a header (`EventSource`
    cannot send one): sets a signed, short-lived, HttpOnly, SameSite=Strict cookie that
    only `GET /v1/runs/{run_id}/events` accepts, for this tenant and this run only."""
    await owned(rt, tenant, run_id)  # another tenant's run: 404, like a missing one
    token = mint_events_grant(state.authenticator.grant_key, tenant, run_id)
    response = Response(status_code=204)
    response.set_cookie(
        GRANT_COOKIE,
        token,
        max_age=GRANT_TTL_S,
        path=f"/v1/runs/{run_id}/events",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )
    response.headers["Cache-Control"] = "no-store"
    return response


# The page's files: revalidated on every load (a 304 when unchanged), never taken from a
# browser's heuristic cache: the page and its ES modules must come from one version, or a
# cached module of an older version breaks the page after an upgrade.
_STATIC_HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}


class _PageFiles(StaticFiles):
    async def get_response(self, path: str, scope) -> Response:
        response = await super().get_response(path, scope)
        for name, value in _STATIC_HEADERS.items():
            response.headers.setdefault(name, value)
        return response


def mount_static(app) -> None:
    """Serve the page's files under /ui/static/ (open paths: they hold no data)."""
    app.mount("/ui/static", _PageFiles(directory=STATIC_DIR), name="ui-static")
