"""The simulated GPU memory of a node, alone or shared with other nodes (``--gpu DIR``), for sleep-mode tests.

A node holds its weights (``--weights-gib``) and its KV cache (``--kv-cache-gib``) on the GPU while awake; vLLM's
sleep level 1 offloads the weights to CPU memory and discards the KV cache, level 2 discards both, and waking
allocates them again. Nodes given the same ``--gpu`` directory share one device of ``--gpu-capacity-gib``: each
writes what it holds to a file of its own there, and an allocation that would take the device past its capacity
fails as CUDA's would (out of memory), so a test can show two models time-sharing one GPU. Without ``--gpu`` the
device is the node's alone and never full.
"""

from __future__ import annotations

import fcntl
import logging
import re
from pathlib import Path
from typing import Protocol

log = logging.getLogger(__name__)

GIB = 1 << 30
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


class OutOfMemory(Exception):
    """The device has not ``wanted`` bytes free; the message reads like CUDA's."""


class Gpu(Protocol):
    def hold(self, used: int) -> None:
        """Hold ``used`` bytes from now on; raises ``OutOfMemory`` (holding what it held) when they do not fit."""
        ...

    def release(self) -> None:
        """The node stops: its memory is free again."""
        ...


class OwnGpu:
    """A device no other node uses: every allocation fits."""

    def hold(self, used: int) -> None:
        return None

    def release(self) -> None:
        return None


class SharedGpu:
    """A device shared through a directory: one file per node with the bytes it holds, changed under a lock."""

    def __init__(self, directory: Path, node: str, capacity: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self._dir = directory
        self._mine = directory / f"{_UNSAFE.sub('_', node)}.bytes"
        self._capacity = capacity
        self._held = 0

    def hold(self, used: int) -> None:
        with open(self._dir / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if used > self._held and self._capacity:
                others = sum(_read(f) for f in self._dir.glob("*.bytes") if f != self._mine)
                if others + used > self._capacity:
                    free = max(0, self._capacity - others - self._held)
                    raise OutOfMemory(
                        f"CUDA out of memory. Tried to allocate {(used - self._held) / GIB:.2f} GiB. GPU has a total "
                        f"capacity of {self._capacity / GIB:.2f} GiB of which {free / GIB:.2f} GiB is free."
                    )
            self._mine.write_text(str(used))
            self._held = used

    def release(self) -> None:
        """The node stops: its memory is free again."""
        self._mine.unlink(missing_ok=True)


def _read(path: Path) -> int:
    try:
        return int(path.read_text() or 0)
    except (OSError, ValueError):
        return 0  # a node that just stopped, or a file being written
