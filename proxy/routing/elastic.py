"""Elastic prefill/decode: for a model served by ``both`` nodes, per request, run it on one node or split it
(prefill on node A, decode on node B, never A = B).

The decision is a function of what the replica knows at that moment and nothing else: each node's own
``/metrics`` as last scraped (the same on every replica), this replica's legs open on it, and how much of the
prompt each node holds by its KV-cache events (the same on every replica within milliseconds). Ties are broken by
a hash of the request and the node, so replicas that see the same request and the same fleet decide alike. Nothing
is kept per request, and no node is told its role: the share of nodes doing prefill work at a time follows the
traffic by itself, as each request goes where its part of the work costs least.

For each node, from those figures:

- ``queue``: prompts waiting there (its ``vllm:num_requests_waiting``, or this replica's prefill legs on it if
  more): what a new prompt waits behind, and what disturbs the sequences generating there;
- ``decoding``: sequences generating there (its ``vllm:num_requests_running``, or this replica's other legs on it
  if more);
- ``new``: the prompt's tokens it does not hold (the index's exact count; without KV events, the replica's
  estimate of the tokens no earlier request had, the same for every node).

A prompt computed on a node slows every sequence generating there while it runs (vLLM's chunked prefill puts a
chunk of it into each step), and a sequence that generates beside prompts being computed gets each of its tokens
later. So the prefill goes where ``new x (1 + HARM x decoding) + queue x prompt`` is least (most of it cached,
little queued, few sequences to disturb), and the decode where ``decoding + BUSY x queue`` is least (a KV cache
nearly full counts as worse than any), among the nodes that can decode other than the prefill node.

The request runs on one node (the ``both`` role's policy picks it, as for a mixed node) when:

- ``few_new``: the prefill node would compute fewer than ``--split-min-prompt-tokens`` new tokens (a short prompt,
  or the next turn of a conversation whose start a node holds): moving the KV cache would cost more than it saves;
- ``one_token``: the client asks for one token (``max_tokens`` 1): nothing is left to decode;
- ``no_pair``: no node other than the prefill node can decode;
- ``no_gain``: the prefill node is itself a better place to decode than any other (``decoding + BUSY x queue``
  less than theirs): splitting would move the decode somewhere worse.

Otherwise it is split (``split``; ``unknown`` when the prompt's size is not known at all, as the disaggregated flow
does for every request). A request with fixed prefill and decode nodes beside the ``both`` ones is placed the same
way: prefill nodes are prefill candidates only, decode nodes decode candidates only.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from vllm_etcd_proxy.proxy.discovery.pool import NodeState
from vllm_etcd_proxy.proxy.kvcache.prompt.ids import KvPrompt
from vllm_etcd_proxy.proxy.routing.balancer import _mix, _stable_hash
from vllm_etcd_proxy.proxy.routing.kv_aware import KV_FULL, KvRouting

HARM = 0.25
"""How much each sequence generating on a node adds to the cost of computing a prompt there (a prompt on a node
with 4 sequences costs twice what it costs on an idle one)."""
BUSY = 8
"""How many generating sequences a prompt queued on a node counts as, for placing a decode there: a decode beside
prompts being computed gets every token later, so a node doing prefill work is a poor place to decode."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Ask:
    """What the decision needs of a request."""

    prompt: KvPrompt | None
    """The prompt's token ids, when known (the index then says exactly what each node holds)."""
    new_tokens: int | None
    """Without ids: the replica's estimate of the prompt's tokens no earlier request had (None: unknown)."""
    max_tokens: int | None
    """The answer's length limit, when the body gives one."""
    key: str
    """What ties are broken by: the request's affinity key, else its id."""


@dataclass(frozen=True, slots=True)
class Plan:
    """Where a request goes: ``split`` empty, on one node (the role policy's choice); else the prefill leg to the
    first node of ``prefill`` that takes it, the decode leg to the first of ``decode`` that is not that node."""

    reason: str
    prefill: tuple[NodeState, ...] = ()
    decode: tuple[NodeState, ...] = ()

    @property
    def split(self) -> bool:
        return bool(self.prefill)


def queue(state: NodeState) -> int:
    """Prompts waiting on the node: its own count, or this replica's prefill legs on it if more."""
    return max(state.node_waiting, state.prefilling)


def decoding(state: NodeState) -> int:
    """Sequences generating on the node: its own count, or this replica's other legs on it if more."""
    return max(state.node_running, state.in_flight - state.prefilling)


def decode_load(state: NodeState) -> int:
    return decoding(state) + BUSY * queue(state)


class Elastic:
    """Decides, per request, local or split (module docstring); ``decisions`` counts (decision, reason)."""

    def __init__(self, kv: KvRouting, split_min_tokens: int) -> None:
        self._kv = kv
        self._min = split_min_tokens
        self.decisions: Counter[tuple[str, str]] = Counter()

    def plan(self, ask: Ask, prefill: Sequence[NodeState], decode: Sequence[NodeState]) -> Plan:
        """Local or split for ``ask``, given the nodes that can prefill and those that can decode (the ``both``
        nodes among both lists), each routable and admitting requests now."""
        held, keys = self._held(ask.prompt, [*prefill, *decode])
        size = len(ask.prompt.ids) if ask.prompt is not None else ask.new_tokens
        seed = _stable_hash(ask.key)

        def new(state: NodeState) -> int:
            return (size or 1) - held.get(id(state), 0) if ask.prompt is not None else (size or 1)

        def prefill_rank(state: NodeState) -> tuple[float, int, int]:
            cost = new(state) * (1 + HARM * decoding(state)) + queue(state) * (size or 1)
            return cost, -held.get(id(state), 0), _mix(seed ^ _stable_hash(state.node.node_id))

        def decode_rank(state: NodeState) -> tuple[bool, int, int]:
            full = state.kv_usage >= KV_FULL
            return full, decode_load(state), _mix(seed ^ _stable_hash(state.node.node_id))

        prefills = tuple(sorted(prefill, key=prefill_rank))
        decodes = tuple(sorted(decode, key=decode_rank))
        reason = self._local_reason(ask, size, prefills, decodes, new)
        if reason is not None:
            return self._decided(Plan(reason))
        plan = Plan("split" if size is not None else "unknown", prefills, decodes)
        self._remember(plan, keys, held, ask.prompt)
        return self._decided(plan)

    def _local_reason(
        self,
        ask: Ask,
        size: int | None,
        prefills: Sequence[NodeState],
        decodes: Sequence[NodeState],
        new: Callable[[NodeState], int],
    ) -> str | None:
        """Why the request runs on one node, or None to split it."""
        if not prefills:
            return "no_pair"
        first = prefills[0]
        if size is not None and new(first) < self._min:
            return "few_new"
        if ask.max_tokens == 1:
            return "one_token"
        others = [s for s in decodes if s is not first]
        if not others:
            return "no_pair"
        if first in decodes and decode_load(first) < decode_load(others[0]):
            return "no_gain"
        return None

    def _held(self, prompt: KvPrompt | None, nodes: Sequence[NodeState]) -> tuple[dict[int, int], dict[int, list[int]]]:
        """Tokens of the prompt each node holds (by ``id`` of its state), and the prompt's block keys at its block
        size, from the KV-event index; empty when the prompt is unknown or no node publishes events."""
        if prompt is None:
            return {}, {}
        unique = list({id(s): s for s in nodes}.values())
        found = self._kv.cached(prompt, unique) or []
        return {id(s): tokens for s, tokens, _ in found}, {id(s): keys for s, _, keys in found}

    def _remember(self, plan: Plan, keys: dict[int, list[int]], held: dict[int, int], prompt: KvPrompt | None) -> None:
        """Count the prompt as cached where it is to be decoded (the node that holds the conversation next, with
        the answer), until that node's own events say so: a quick next turn then finds it there."""
        target = next((s for s in plan.decode if s is not plan.prefill[0]), None)
        if prompt is None or target is None or id(target) not in keys:
            return
        self._kv.sent(target, keys[id(target)], held.get(id(target), 0), prompt.complete)

    def _decided(self, plan: Plan) -> Plan:
        self.decisions["split" if plan.split else "local", plan.reason] += 1
        return plan
