"""httpx clients that keep no client state between requests.

httpx stores every ``Set-Cookie`` it sees in the client's jar and sends it on all later requests to that
host. A replica's clients are shared by every user of the replica, so a cookie one user's request caused
would then reach every other user's requests. The jar here refuses to store anything: a node's
``Set-Cookie`` goes back to the one client that caused it, and a client's own ``Cookie`` header is
forwarded on that client's requests only.
"""

from __future__ import annotations

import http.cookiejar
import urllib.request
from typing import Any

import httpx


class _RefusingJar(http.cookiejar.CookieJar):
    """A cookie jar that never holds a cookie."""

    def set_cookie(self, cookie: http.cookiejar.Cookie) -> None:
        return

    def extract_cookies(self, response: Any, request: urllib.request.Request) -> None:
        return


def stateless_client(**options: Any) -> httpx.AsyncClient:
    """An ``httpx.AsyncClient`` with no cookie jar and no proxy from the environment (nodes sit next to us:
    an HTTP(S)_PROXY meant for the outside must not apply)."""
    return httpx.AsyncClient(cookies=_RefusingJar(), trust_env=False, **options)
