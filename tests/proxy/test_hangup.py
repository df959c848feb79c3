"""SIGHUP reloads (operations/hangup.py), with real signals to this process: one that comes while the replica
starts (after its files are read, before its loop handles the signal) is not lost, and none is invented."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator

import pytest

from vllm_etcd_proxy.proxy.operations.hangup import Hangup, StartHangups


@pytest.fixture(autouse=True)
def restore_sighup() -> Iterator[None]:
    before = signal.getsignal(signal.SIGHUP)
    yield
    signal.signal(signal.SIGHUP, before)


async def reloads_seen(hangup: Hangup, reloaded: asyncio.Queue[str], *, send: bool, expect: int) -> list[str]:
    """The reloads ``hangup`` runs: ``expect`` of them awaited (5 s at most), then 0.2 s for one too many."""
    task = asyncio.create_task(hangup.run())
    try:
        await asyncio.sleep(0)  # the loop's handler is in place
        if send:
            os.kill(os.getpid(), signal.SIGHUP)
        seen = [await asyncio.wait_for(reloaded.get(), 5) for _ in range(expect)]
        await asyncio.sleep(0.2)
        while not reloaded.empty():
            seen.append(reloaded.get_nowait())
        return seen
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def run(at_start: StartHangups, *, send: bool, expect: int) -> list[str]:
    async def main() -> list[str]:
        reloaded: asyncio.Queue[str] = asyncio.Queue()
        hangup = Hangup(at_start)
        hangup.on("certificate", lambda: reloaded.put_nowait("certificate"))
        return await reloads_seen(hangup, reloaded, send=send, expect=expect)

    return asyncio.run(main())


def test_a_sighup_while_starting_reloads_once_the_loop_handles_the_signal() -> None:
    at_start = StartHangups()
    at_start.catch()
    os.kill(os.getpid(), signal.SIGHUP)  # the files were read, the app is not running yet: noted, not fatal
    assert at_start.arrived
    assert run(at_start, send=False, expect=1) == ["certificate"]


def test_no_sighup_while_starting_means_no_reload_until_one_comes() -> None:
    at_start = StartHangups()
    at_start.catch()
    assert run(at_start, send=False, expect=0) == []
    assert run(at_start, send=True, expect=1) == ["certificate"]
