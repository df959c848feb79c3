"""The Responses API across stateless replicas: a response's id says which node keeps it.

vLLM keeps each response (for ``previous_response_id``, ``GET``/``DELETE``/``cancel`` by id, background polling)
in the memory of the node that made it, and takes the id from the request body's ``request_id``. So the proxy
gives every new response an id of its own making, ``resp_vp{token}{random}``, where ``token`` is the first 12 hex
digits of the SHA-256 of the node's id: every replica computes the same token for the same node, so any replica
finds the holder of any response with nothing shared and nothing written per request, and the id does not show
the node's address. A ``request_id`` the client chose is left alone; such a response can only be found again
through the node that made it, and the proxy says so.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping
from typing import Any

from vllm_etcd_proxy.proxy.discovery.pool import NodeState, Pool
from vllm_etcd_proxy.proxy.errors import BadRequest, NotFound
from vllm_etcd_proxy.proxy.serving.bodies import with_field

_OURS = re.compile(r"^resp_vp([0-9a-f]{12})[0-9a-f]{24}$")
_MAX_TOKENS_KEPT = 100_000
"""Node tokens remembered (one per node id ever seen); the memo starts over past this."""


class ResponseNotFound(NotFound):
    code = "response_not_found"


class ResponseIds:
    """Mints response ids for a node and finds the node behind an id, from the pool alone."""

    def __init__(self, pool: Pool) -> None:
        self._pool = pool
        self._tokens: dict[str, str] = {}
        self._holders: dict[str, str] = {}
        """Node token -> the pool entry key last seen holding it, so a lookup by id is O(1), not a scan."""

    def token(self, node_id: str) -> str:
        token = self._tokens.get(node_id)
        if token is None:
            if len(self._tokens) >= _MAX_TOKENS_KEPT:
                self._tokens.clear()
            token = self._tokens[node_id] = hashlib.sha256(node_id.encode()).hexdigest()[:12]
        return token

    def mint(self, state: NodeState) -> str:
        token = self.token(state.node.node_id)
        self._remember(token, state)
        return f"resp_vp{token}{os.urandom(12).hex()}"

    def _remember(self, token: str, state: NodeState) -> None:
        if len(self._holders) >= _MAX_TOKENS_KEPT:
            self._holders.clear()
        self._holders[token] = state.entry_key

    @staticmethod
    def is_ours(response_id: str) -> bool:
        """True for an id this proxy minted (so it names its node)."""
        return _OURS.match(response_id) is not None

    def holder(self, response_id: str) -> NodeState:
        """The node keeping ``response_id``; ``ResponseNotFound`` saying why when there is none."""
        match = _OURS.match(response_id)
        if match is None:
            raise ResponseNotFound(
                f"Response with id '{response_id}' was not made through this proxy (its request chose its own "
                "request_id), so no replica can tell which node keeps it; ask that node directly",
                param="response_id",
            )
        token = match.group(1)
        key = self._holders.get(token)
        known = self._pool.get(key) if key is not None else None
        if known is not None and self.token(known.node.node_id) == token:
            return known
        for state in self._pool.all():  # minted by another replica, or the node re-registered under a new key
            if self.token(state.node.node_id) == token:
                self._remember(token, state)
                return state
        raise ResponseNotFound(
            f"Response with id '{response_id}' not found: the node that made it has left the fleet, and a "
            "response lives only in its node's memory",
            param="response_id",
        )

    def new_response_body(self, raw: bytes, body: Mapping[str, Any], state: NodeState) -> bytes:
        """The body for ``state``: the client's, with a ``request_id`` naming that node unless it chose one."""
        if "request_id" in body:
            return raw
        return with_field(raw, body, "request_id", self.mint(state))


def previous_response_id(body: Mapping[str, Any]) -> str | None:
    """The ``previous_response_id`` a new response continues, if any (400 when it is not a string)."""
    previous = body.get("previous_response_id")
    if previous is None:
        return None
    if not isinstance(previous, str) or not previous:
        raise BadRequest("'previous_response_id' must be a non-empty string", param="previous_response_id")
    return previous
