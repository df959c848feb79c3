"""One node's memory of its Responses API responses: the response object, the input messages its next turn
builds on, and its streamed events, which readers can follow while the response is still generating."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

Event = dict[str, Any]


@dataclass(eq=False, kw_only=True)
class Stored:
    """One response in this node's memory."""

    response: dict[str, Any]
    messages: list[tuple[str, str]]
    """The input messages of its turn (what the next turn builds on)."""
    events: list[Event] = field(default_factory=list)
    finished: bool = False
    task: asyncio.Task[None] | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def add(self, event: Event) -> None:
        self.events.append(event)
        self._signal()

    def finish(self) -> None:
        self.finished = True
        self._signal()

    def _signal(self) -> None:
        changed, self.changed = self.changed, asyncio.Event()
        changed.set()

    async def tail(self, after: int) -> AsyncGenerator[Event, None]:
        """The events after sequence number ``after``, following the response until it ends."""
        index = after + 1
        while True:
            changed = self.changed
            while index < len(self.events):
                yield self.events[index]
                index += 1
            if self.finished:
                return
            await changed.wait()
