"""Where the key set comes from besides the flags: ``--api-key-file`` (read at start and on SIGHUP) and the
``keys/`` folder in etcd (a discovery sink). A bad line or value is skipped with a warning and a metric; the
other keys are not disturbed, and a file that cannot be read on reload leaves the keys as they were."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from vllm_etcd_proxy.proxy.tenancy.keys import InvalidKey, KeySet, Limits, parse_value, read_key_file

log = logging.getLogger(__name__)


class KeyFile:
    """``--api-key-file``: ``load`` at start (an unreadable file is fatal then), ``reload`` on SIGHUP."""

    def __init__(self, path: str, keys: KeySet, on_invalid: Callable[[str], None]) -> None:
        self.path = path
        self._keys = keys
        self._on_invalid = on_invalid

    def _read(self) -> dict[bytes, Limits]:
        def invalid(number: int, reason: str) -> None:
            log.warning("ignoring invalid line of --api-key-file path=%s line=%d reason=%s", self.path, number, reason)
            self._on_invalid("file")

        return read_key_file(self.path, invalid)

    def load(self) -> None:
        """Raises ``ValueError`` when the file cannot be read."""
        try:
            self._keys.set_file(self._read())
        except OSError as exc:
            raise ValueError(f"--api-key-file: {exc.strerror}: {self.path}") from None

    def reload(self) -> bool:
        try:
            entries = self._read()
        except (OSError, UnicodeDecodeError) as exc:
            log.warning(
                "--api-key-file not reloaded path=%s error=%s; keeping the keys loaded before",
                self.path,
                getattr(exc, "strerror", None) or exc,
            )
            return False
        self._keys.set_file(entries)
        log.info("--api-key-file reloaded path=%s keys=%d", self.path, len(entries))
        return True


class EtcdKeys:
    """The ``keys/`` folder as a discovery ``KeySink``: each name is a key's SHA-256, each value its limits."""

    def __init__(self, keys: KeySet, on_invalid: Callable[[str], None]) -> None:
        self._keys = keys
        self._on_invalid = on_invalid
        self._names: dict[str, bytes] = {}

    def replace(self, entries: Mapping[str, bytes]) -> Mapping[str, str]:
        valid: dict[bytes, Limits] = {}
        invalid: dict[str, str] = {}
        self._names = {}
        for name, value in entries.items():
            try:
                digest, limits = parse_value(name, value)
            except InvalidKey as exc:
                invalid[name] = str(exc)
                self._on_invalid("etcd")
                continue
            valid[digest], self._names[name] = limits, digest
        self._keys.set_etcd(valid)
        return invalid

    def put(self, name: str, value: bytes) -> str | None:
        try:
            digest, limits = parse_value(name, value)
        except InvalidKey as exc:
            self.delete(name)  # a key whose value went bad is no longer valid
            self._on_invalid("etcd")
            return str(exc)
        self._names[name] = digest
        self._keys.put_etcd(digest, limits)
        return None

    def delete(self, name: str) -> None:
        digest = self._names.pop(name, None)
        if digest is not None:
            self._keys.put_etcd(digest, None)
