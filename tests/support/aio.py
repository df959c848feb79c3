"""Polling with a deadline for asyncio tests: wait for a condition, never sleep as synchronisation."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable


async def eventually(check: Callable[[], bool | Awaitable[bool]], timeout: float, what: str) -> None:
    """Poll ``check`` (sync or async) until it is true; fail after ``timeout`` seconds naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.05)


async def holds(check: Callable[[], bool | Awaitable[bool]], duration: float, what: str) -> None:
    """Assert ``check`` stays true for ``duration`` seconds (for "still there after the TTL" claims)."""
    deadline = time.monotonic() + duration
    while time.monotonic() < deadline:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        assert result, f"{what} stopped holding"
        await asyncio.sleep(0.1)
