"""The LoRA adapters registered in etcd (``{prefix}/{cluster}/adapters/{name}``), as this replica knows them.

A ``KeySink`` for discovery (watch.py): it keeps the valid records and answers the reason for the others, which
discovery logs and counts as invalid records. Readers (``/v1/models``, the loader) ask ``get`` and ``all``.
Unregistering an adapter stops new loads and tells ``on_unregistered`` listeners (the loader unloads it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from vllm_etcd_proxy.fleet.adapters import Adapter, parse_adapter
from vllm_etcd_proxy.fleet.records import InvalidRecord

log = logging.getLogger(__name__)


class AdapterRegistry:
    """Adapter name -> ``Adapter``, replaced by discovery's list and kept current by its watch."""

    def __init__(self) -> None:
        self._adapters: dict[str, Adapter] = {}
        self._unregistered: list[Callable[[str], None]] = []

    def on_unregistered(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(name)`` when an adapter that was registered is no longer (deleted, or gone in a list)."""
        self._unregistered.append(listener)

    def _gone(self, name: str) -> None:
        for listener in self._unregistered:
            listener(name)

    def replace(self, entries: Mapping[str, bytes]) -> Mapping[str, str]:
        adapters, invalid = {}, {}
        for name, value in entries.items():
            try:
                adapters[name] = parse_adapter(name, value)
            except InvalidRecord as exc:
                invalid[name] = str(exc)
        gone = [name for name in self._adapters if name not in adapters]
        self._adapters = adapters
        log.info("adapters listed count=%d invalid=%d", len(adapters), len(invalid))
        for name in gone:
            self._gone(name)
        return invalid

    def put(self, name: str, value: bytes) -> str | None:
        try:
            adapter = parse_adapter(name, value)
        except InvalidRecord as exc:
            # Garbage put over a valid record: the adapter is no longer registered (no new loads).
            if self._adapters.pop(name, None) is not None:
                self._gone(name)
            return str(exc)
        if self._adapters.get(name) != adapter:
            log.info("adapter registered name=%s base=%s", name, adapter.base)
        self._adapters[name] = adapter
        return None

    def delete(self, name: str) -> None:
        if self._adapters.pop(name, None) is not None:
            log.info("adapter unregistered name=%s", name)
            self._gone(name)

    def get(self, name: str) -> Adapter | None:
        return self._adapters.get(name)

    def all(self) -> list[Adapter]:
        """Every registered adapter, by name."""
        return [self._adapters[n] for n in sorted(self._adapters)]
