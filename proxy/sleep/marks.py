"""A node's sleep mark (``sleep`` in its record): written into etcd, so that every replica stops (or resumes)
sending the node requests within one watch event, and into this replica's pool at once.

The record is edited in place under its own lease (a registrar's, an admin's none) in a transaction on its mod
revision, so a registrar's concurrent write is never undone (the edit is retried on the new value; the registrar
keeps the mark in its own later writes). A bare key (empty value) becomes the record it stood for. Nodes without
a key (static flags) are marked in this replica's pool only.
"""

from __future__ import annotations

import logging

from vllm_etcd_proxy.fleet.etcd import EtcdClient, EtcdError
from vllm_etcd_proxy.fleet.pb.node_record_pb2 import NodeRecord
from vllm_etcd_proxy.fleet.records import InvalidRecord, Node, Sleep, decode_record, encode_record
from vllm_etcd_proxy.proxy.discovery.pool import NodeState, Pool

log = logging.getLogger(__name__)

ATTEMPTS = 5
"""Edits of one record tried while others keep changing it."""


class MarkFailed(Exception):
    """The mark could not be written (etcd unreachable, the key gone or invalid); the message says which."""


class SleepMarks:
    def __init__(self, pool: Pool, etcd: EtcdClient | None) -> None:
        self._pool = pool
        self._etcd = etcd

    async def set(self, state: NodeState, mark: Sleep, *, expect: Sleep | None = None) -> bool:
        """Mark the node; with ``expect``, only while its mark is still that (False when someone else changed it:
        a wake during a drain). Raises ``MarkFailed``."""
        if expect is not None and state.node.sleep is not expect:
            return False
        key = state.node.key
        if (
            key is not None
            and self._etcd is not None
            and not await self._write(self._etcd, key, state.node, mark, expect)
        ):
            return False
        self._pool.set_sleep_mark(state, mark)
        log.info("sleep mark node=%s sleep=%s", state.node.node_id, mark.value or "awake")
        return True

    async def _write(self, etcd: EtcdClient, key: str, node: Node, mark: Sleep, expect: Sleep | None) -> bool:
        try:
            for _ in range(ATTEMPTS):
                current = await etcd.get(key)
                if current is None:
                    raise MarkFailed(f"node {node.node_id} has no key in etcd any more")
                record = _record(current.value, node)
                if expect is not None and record.sleep != expect.value:
                    return False
                record.sleep = mark.value
                value = encode_record(record)
                if await etcd.put_if(key, value, mod_revision=current.mod_revision, lease=current.lease):
                    return True
        except EtcdError as exc:
            raise MarkFailed(f"could not write the sleep mark of node {node.node_id} to etcd: {exc}") from None
        raise MarkFailed(f"the record of node {node.node_id} kept changing; its sleep mark was not written")


def _record(value: bytes, node: Node) -> NodeRecord:
    """The record a value holds; for a bare key, the one it stands for (its URL, models learned from the node)."""
    if not value.strip():
        return NodeRecord(url=node.url, role=node.role.value)
    try:
        return decode_record(value)
    except InvalidRecord as exc:
        raise MarkFailed(f"the record of node {node.node_id} is not valid: {exc}") from None
