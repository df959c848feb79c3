"""Elastic prefill/decode: for a model served by ``both`` nodes, per request, run it on one node or split it
(prefill on node A, decode on node B, never A = B).

The decision is a function of what the replica knows at that moment and nothing else: each node's own
``/metrics`` as last scraped (the same on every replica), this replica's legs open on it, and how much of the
prompt each node holds by its KV-cache events (the same on every replica within milliseconds); and each model's
order of its nodes, a hash of model and node, the same on every replica. Replicas that see the same request and the
same fleet decide alike. Nothing is kept per request, and no node is told its role: the share of nodes doing
prefill work at a time follows the traffic by itself, as each request goes where its part of the work costs least
and prompts look for a node from the front of the order, decodes from the back.

For each node, from those figures (``work``): its requests (``vllm:num_requests_running`` + ``waiting``, or this
replica's legs on it if more), split into

- ``prompts``: prompts being computed or waiting there, and
- ``decoding``: sequences generating there,

in the proportion of this replica's own legs on it (prefill legs against the others): vLLM's figures do not tell
a prompt being computed from a sequence generating, and the other replicas, deciding by the same rules on the
same figures, send a node the same kind of work this one does. With none of its own legs there, waiting requests
count as prompts and running ones as generating.

A prompt computed on a node slows every sequence generating there while it runs (vLLM's chunked prefill puts a
chunk of it into each step), and a sequence that generates beside prompts being computed gets each of its tokens
later. So:

- the prefill goes where ``new x (1 + HARM x decoding) + (prompts + FRONT x place) x size`` is least: ``new``
  the prompt's tokens the node does not hold (the index's exact count; without KV events the replica's estimate of
  the tokens no earlier request had, the same for every node), ``size`` the prompt's, ``place`` the node's in the
  model's order; most of it cached, little queued, few sequences to disturb;
- the decode where ``BUSY x prompts + decoding + BACK x places from the back`` is least, a node where this replica
  has no decode counting ``PACK`` more (the decodes gather on the nodes already generating, which leaves the
  others to the prompts; a KV cache nearly full counts as worse than any), among the nodes that can decode other
  than the prefill node.

The request runs on one node when:

- ``few_new``: the prefill node would compute fewer than ``--split-min-prompt-tokens`` new tokens (a short prompt,
  or the next turn of a conversation whose start a node holds): moving the KV cache would cost more than it saves;
  the ``both`` role's policy picks the node, as for a mixed node (kv-aware: where the conversation is cached);
- ``one_token``: the client asks for one token (``max_tokens`` 1): nothing is left to decode; on the prefill node;
- ``no_pair``: no node other than the prefill node can decode; the policy picks the node;
- ``no_gain``: the prefill node is itself a better place to decode than any other, even counting this prompt as
  computed there: splitting would move the decode somewhere worse; on the prefill node.

Otherwise it is split (``split``; ``unknown`` when the prompt's size is not known at all, as the disaggregated flow
does for every request). With fixed prefill and decode nodes beside the ``both`` ones, a prefill node is a
candidate for the prefill only, a decode node for the decode only.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from vllm_etcd_proxy.fleet.records import Role
from vllm_etcd_proxy.proxy.discovery.pool import NodeState
from vllm_etcd_proxy.proxy.kvcache.prompt.ids import KvPrompt
from vllm_etcd_proxy.proxy.routing.balancer import _stable_hash
from vllm_etcd_proxy.proxy.routing.kv_aware import KV_FULL, KvRouting

HARM = 1.0
"""How much each sequence generating on a node adds to the cost of computing a prompt there, in units of the
prompt's own time: vLLM puts a chunk of the prompt into each of their steps, so each of them is delayed by about
as long as the prompt takes. At 1 the prefill goes where the delay it causes, its own wait included, is least
(bench.elastic: at 2 and 3 the prompts crowded onto the node with no decodes while they were long and the answers
long too, and waited there past the TTFT target)."""
BUSY = 8
"""How many generating sequences a prompt computed on a node counts as, for placing a decode there: a decode beside
prompts being computed gets every token later, so a node doing prefill work is a poor place to decode."""
PACK = 8
"""How many generating sequences a node generating none counts as, for placing a decode there: a decode joins a
node already generating (a bigger batch costs each sequence little) rather than take an idle node from the
prompts."""
FRONT = 0.25
"""Prompts of this one's size that each place further back in the model's order counts as, for the prefill."""
BACK = 0.5
"""Generating sequences that each place further forward in the model's order counts as, for the decode."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Ask:
    """What the decision needs of a request."""

    prompt: KvPrompt | None
    """The prompt's token ids, when known (the index then says exactly what each node holds)."""
    new_tokens: int | None
    """Without ids: the replica's estimate of the prompt's tokens no earlier request had (None: unknown)."""
    max_tokens: int | None
    """The answer's length limit, when the body gives one."""
    model: str
    """The model asked for: each model has its own order of nodes (``_order``)."""


@dataclass(frozen=True, slots=True)
class Plan:
    """Where a request goes. Split: the prefill leg to the first node of ``prefill`` that takes it, the decode leg
    to the first of ``decode`` that is not that node. Else on one node: the first of ``alone`` that takes it, or
    with ``alone`` empty the one the ``both`` role's policy picks (by what the nodes cache)."""

    reason: str
    prefill: tuple[NodeState, ...] = ()
    decode: tuple[NodeState, ...] = ()
    alone: tuple[NodeState, ...] = ()

    @property
    def split(self) -> bool:
        return bool(self.prefill)


def work(state: NodeState) -> tuple[float, float]:
    """(prompts, decoding) on the node: its requests, split as this replica's own legs there are (module
    docstring)."""
    mine = state.in_flight
    total = max(state.node_running + state.node_waiting, mine)
    if not mine:
        return float(state.node_waiting), float(state.node_running)
    prompts = total * state.prefilling / mine
    return prompts, total - prompts


def decode_cost(state: NodeState, more_prompts: int = 0) -> float:
    """What a decode placed on the node costs (``more_prompts``: prompts about to be computed there besides). A
    node counts as generating, for ``PACK``, when this replica's own decodes are there: a node that only runs
    another replica's requests may be computing its prompts."""
    prompts, decoding = work(state)
    prompts += more_prompts
    generating = state.in_flight > state.prefilling
    return BUSY * prompts + decoding + (0 if generating else PACK)


def _order(model: str, nodes: Sequence[NodeState]) -> dict[int, int]:
    """Each node's place (by ``id`` of its state) in the model's order, the same on every replica: prefills look
    from the front, decodes from the back, so the replicas' prompts gather on the same nodes and their decodes on
    the others, wherever the loads leave the line between them."""
    unique = {s.node.node_id: s for s in nodes}
    ranked = sorted(unique, key=lambda node_id: _stable_hash(f"{model}#{node_id}"))
    place = {id(unique[node_id]): i for i, node_id in enumerate(ranked)}
    return {id(s): place[id(unique[s.node.node_id])] for s in nodes}


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
        place = _order(ask.model, [*prefill, *decode])
        last = len(place) - 1

        def new(state: NodeState) -> int:
            return (size or 1) - held.get(id(state), 0) if ask.prompt is not None else (size or 1)

        def prefill_rank(state: NodeState) -> tuple[float, int, int]:
            prompts, decoding = work(state)
            cost = new(state) * (1 + HARM * decoding) + (prompts + FRONT * place[id(state)]) * (size or 1)
            return cost, -held.get(id(state), 0), place[id(state)]

        def decode_rank(state: NodeState) -> tuple[bool, float, int]:
            full = state.kv_usage >= KV_FULL
            return full, decode_cost(state) + BACK * (last - place[id(state)]), -place[id(state)]

        prefills = tuple(sorted(prefill, key=prefill_rank))
        decodes = tuple(sorted(decode, key=decode_rank))
        reason = self._local_reason(ask, size, prefills, decodes, new)
        if reason is not None:
            # Where the prompt is best computed, when that is the work; where it is cached, by the policy, else.
            alone = tuple(s for s in prefills if s.node.role is Role.BOTH) if reason in ("one_token", "no_gain") else ()
            return self._decided(Plan(reason, alone=alone))
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
        if first in decodes and decode_cost(first, more_prompts=1) < decode_cost(others[0]):
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
