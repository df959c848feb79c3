"""``GET /dashboard``: one self-contained HTML page (no external script, style or font: fleets often have no
internet) that shows the fleet live by polling this replica's ``/status``, ``/list_workers`` and ``/metrics``.

Open like the other status routes, and it shows only what they show: no keys, no prompts. Its Content
Security Policy lets it talk to this replica alone.
"""

from __future__ import annotations

from importlib.resources import files

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

_CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


class DashboardRoutes:
    def __init__(self) -> None:
        self._page = files(__package__).joinpath("dashboard.html").read_bytes()

    def routes(self) -> list[Route]:
        return [Route("/dashboard", self.dashboard, methods=["GET"])]

    async def dashboard(self, request: Request) -> Response:
        return Response(
            self._page,
            media_type="text/html; charset=utf-8",
            headers={"content-security-policy": _CSP, "cache-control": "no-cache", "x-content-type-options": "nosniff"},
        )
