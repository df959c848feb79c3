"""How a request reaches its node: the flows, and the choice between them (``Flows.pick``).

Each flow is a class with one method, ``open(request, avoid)``, that sends the request's leg(s) through the
forwarder and returns the node's open response (or its error answer, read whole):

- ``OneLeg``: to a node of the model, the body byte for byte (``mixed``; ``decode`` when so little of a
  disaggregated model's prompt is new that a prefill leg would cost more than it saves);
- ``Alone``: a request to ``both`` nodes that routing/elastic.py runs on one of them (``local``);
- ``DisaggregatedFlow`` (disagg.py): vLLM's prefill -> decode exchange (``disagg``; ``split`` between ``both``
  nodes, on the nodes routing/elastic.py ranked);
- ``WithAdapter``: a registered LoRA adapter loaded on a node first (serving/adapters.py), then ``OneLeg``,
  ``NewResponse`` (the Responses API) or, for a disaggregated base model, the exchange (loaded on a prefill and a
  decode node);
- ``NewResponse``: ``POST /v1/responses``, to where its ``previous_response_id`` is kept, else by model; the
  new response's id names its node;
- ``ByResponseId``: ``/v1/responses/{id}...``, to the node holding that id.

``pick`` looks only at the request and the pool; a resumed stream's continuation is picked for again (its prompt
is longer, and the node it broke on is avoided, also by the split of a request to ``both`` nodes).
"""

from __future__ import annotations

from typing import Protocol

from vllm_etcd_proxy.fleet.records import Role
from vllm_etcd_proxy.proxy.discovery.pool import NodeState, Pool
from vllm_etcd_proxy.proxy.errors import ModelNotFound, NoNodeAvailable
from vllm_etcd_proxy.proxy.routing.elastic import Ask, Elastic
from vllm_etcd_proxy.proxy.routing.kv_aware import KvRouting
from vllm_etcd_proxy.proxy.serving.adapters import DISAGGREGATED, ROLES, AdapterLoader, with_adapter
from vllm_etcd_proxy.proxy.serving.disagg import DisaggregatedFlow
from vllm_etcd_proxy.proxy.serving.forwarder import ErrorAnswer, Forwarder, Leg, Upstream
from vllm_etcd_proxy.proxy.serving.request import ProxyRequest
from vllm_etcd_proxy.proxy.serving.responses import ResponseIds, previous_response_id
from vllm_etcd_proxy.proxy.serving.routes import Kind, response_id_of
from vllm_etcd_proxy.proxy.serving.sessions import SessionFlow

MIXED_ROLES = (Role.MIXED, Role.BOTH, Role.DECODE)
"""Nodes that serve a request alone, in the order tried (the first role with a node available wins)."""
DECODE_FIRST = (Role.DECODE, Role.MIXED)
LOCAL_ROLES = (Role.BOTH, Role.MIXED)
"""Where a request to ``both`` nodes runs when it is not split."""


class Flow(Protocol):
    mode: str
    """Its name in metrics."""

    async def open(self, request: ProxyRequest, avoid: tuple[NodeState, ...] = ()) -> Upstream | ErrorAnswer:
        """Send the request to a node (not one of ``avoid`` while another is left) and return its answer."""
        ...


class OneLeg:
    """The request to one node of ``roles`` (tried in order), its body byte for byte."""

    __slots__ = ("mode", "_roles", "_forwarder", "_timeout")

    def __init__(self, mode: str, roles: tuple[Role, ...], forwarder: Forwarder, timeout: float) -> None:
        self.mode, self._roles, self._forwarder, self._timeout = mode, roles, forwarder, timeout

    async def open(self, request: ProxyRequest, avoid: tuple[NodeState, ...] = ()) -> Upstream | ErrorAnswer:
        leg = Leg(roles=self._roles, body=request.raw, timeout=self._timeout, narrow=True)
        return await self._forwarder.open(request, leg, avoid)


class Alone:
    """A request to ``both`` nodes that routing/elastic.py runs on one node: the node it ranked first that takes
    it (``request.plan.alone``), else the one the role's policy picks."""

    mode = "local"
    __slots__ = ("_forwarder", "_timeout")

    def __init__(self, forwarder: Forwarder, timeout: float) -> None:
        self._forwarder, self._timeout = forwarder, timeout

    async def open(self, request: ProxyRequest, avoid: tuple[NodeState, ...] = ()) -> Upstream | ErrorAnswer:
        plan = request.plan
        order = plan.alone if plan is not None and plan.alone else None
        leg = Leg(roles=LOCAL_ROLES, body=request.raw, timeout=self._timeout, order=order)
        return await self._forwarder.open(request, leg, avoid)


class WithAdapter:
    """A registered LoRA adapter's request: the adapter loaded first, when no node has it, on a node of each role
    group the inner flow's legs go to."""

    __slots__ = ("mode", "_loader", "_flow", "_groups")

    def __init__(self, loader: AdapterLoader, flow: Flow, groups: tuple[tuple[Role, ...], ...] = (ROLES,)) -> None:
        self.mode, self._loader, self._flow, self._groups = flow.mode, loader, flow, groups

    async def open(self, request: ProxyRequest, avoid: tuple[NodeState, ...] = ()) -> Upstream | ErrorAnswer:
        assert request.adapter is not None
        flow = self._flow
        return await with_adapter(self._loader, request.adapter, lambda: flow.open(request, avoid), self._groups)


class ByResponseId:
    """To the node that holds the response the path names (``request.pinned``)."""

    mode = "pinned"
    __slots__ = ("_forwarder", "_timeout")

    def __init__(self, forwarder: Forwarder, timeout: float) -> None:
        self._forwarder, self._timeout = forwarder, timeout

    async def open(self, request: ProxyRequest, avoid: tuple[NodeState, ...] = ()) -> Upstream | ErrorAnswer:
        assert request.pinned is not None
        leg = Leg(roles=(request.pinned.node.role,), body=request.raw, timeout=self._timeout)
        return await self._forwarder.open(request, leg, avoid)


class NewResponse:
    """A new response: to its previous response's node (``request.pinned``), else by model; its body gains a
    ``request_id`` that names the node chosen."""

    __slots__ = ("mode", "_forwarder", "_ids", "_timeout")

    def __init__(self, mode: str, forwarder: Forwarder, ids: ResponseIds, timeout: float) -> None:
        self.mode, self._forwarder, self._ids, self._timeout = mode, forwarder, ids, timeout

    async def open(self, request: ProxyRequest, avoid: tuple[NodeState, ...] = ()) -> Upstream | ErrorAnswer:
        raw, body, ids = request.raw, request.body, self._ids
        assert body is not None
        leg = Leg(
            roles=MIXED_ROLES,
            body=raw,
            timeout=self._timeout,
            body_for=lambda state: ids.new_response_body(raw, body, state),
        )
        return await self._forwarder.open(request, leg, avoid)


class Flows:
    """The flows of one replica, and which one a request takes."""

    def __init__(
        self,
        pool: Pool,
        forwarder: Forwarder,
        adapters: AdapterLoader,
        kv: KvRouting,
        *,
        first_byte_timeout: float,
        prefill_timeout: float,
        pd_min_prompt_tokens: int,
        elastic: Elastic,
        session: SessionFlow,
    ) -> None:
        self._pool, self._adapters, self._kv = pool, adapters, kv
        self._ids = ResponseIds(pool)
        self._pd_min = pd_min_prompt_tokens
        self._elastic = elastic
        self.mixed = OneLeg("mixed", MIXED_ROLES, forwarder, first_byte_timeout)
        self.decode = OneLeg("decode", DECODE_FIRST, forwarder, first_byte_timeout)
        self.disaggregated = DisaggregatedFlow(forwarder, first_byte_timeout, prefill_timeout)
        self.local = Alone(forwarder, first_byte_timeout)
        self.split = DisaggregatedFlow(forwarder, first_byte_timeout, prefill_timeout, mode="split")
        self.adapter = WithAdapter(adapters, self.mixed)
        self.adapter_disaggregated = WithAdapter(adapters, self.disaggregated, DISAGGREGATED)
        self.by_response_id = ByResponseId(forwarder, first_byte_timeout)
        self.new_response = NewResponse("mixed", forwarder, self._ids, first_byte_timeout)
        self.adapter_response = WithAdapter(adapters, self.new_response)
        self.continued_response = NewResponse("pinned", forwarder, self._ids, first_byte_timeout)
        self.session = session
        session.check = self.check_routable

    def pick(self, request: ProxyRequest, avoid: tuple[NodeState, ...] = ()) -> Flow:
        """The flow for ``request`` (its body read, its model known); ``ProxyError`` when none can serve it.
        ``avoid``: nodes a resumed stream's continuation is not to be placed on while others are left."""
        kind = request.kind
        if kind is Kind.SESSION:
            self.session.check(self._model(request), MIXED_ROLES)
            return self.session
        if kind is Kind.BY_RESPONSE_ID:
            request.pinned = self._ids.holder(response_id_of(request.path))
            return self.by_response_id
        if kind is Kind.RESPONSES and request.body is not None:
            return self._response(request)
        adapter = self._adapters.registered(self._model(request))
        if kind is Kind.GENERATE and request.body is not None:
            if adapter is not None and self._disaggregated(adapter.base):
                request.adapter = adapter
                return self.adapter_disaggregated
            both = self._pool.candidates(Role.BOTH, self._model(request))
            if both:
                return self._elastic_flow(request, avoid, both)
            if self._disaggregated(request.model):
                return self.decode if self._little_is_new(request) else self.disaggregated
        if adapter is not None:
            request.adapter = adapter
            return self.adapter
        self.check_routable(self._model(request), MIXED_ROLES)
        return self.mixed

    def _disaggregated(self, model: str | None) -> bool:
        pool = self._pool
        return model is not None and pool.available(Role.PREFILL, model) and pool.available(Role.DECODE, model)

    def _elastic_flow(self, request: ProxyRequest, avoid: tuple[NodeState, ...], both: list[NodeState]) -> Flow:
        """A model with ``both`` nodes: routing/elastic.py says whether the request runs on one node or is split,
        and between which nodes (``request.plan``)."""
        body, model, pool = request.body, self._model(request), self._pool
        assert body is not None
        prefill = _without(avoid, [*pool.candidates(Role.PREFILL, model), *both])
        decode = _without(avoid, [*pool.candidates(Role.DECODE, model), *both])
        limit = body.get("max_tokens", body.get("max_completion_tokens"))
        ask = Ask(
            prompt=request.prompt,
            new_tokens=request.uncached_tokens,
            max_tokens=limit if isinstance(limit, int) and not isinstance(limit, bool) else None,
            model=model,
        )
        plan = request.plan = self._elastic.plan(ask, prefill, decode)
        return self.split if plan.split else self.local

    def _little_is_new(self, request: ProxyRequest) -> bool:
        """So little of the prompt is new (``--pd-min-prompt-tokens``) that a prefill leg costs more than it
        saves; the index's exact count when the prompt's ids are known."""
        uncached, prompt = request.uncached_tokens, request.prompt
        if prompt is not None and self._pd_min:
            model, pool = self._model(request), self._pool
            candidates = [s for r in Role for s in pool.candidates(r, model)]
            uncached = self._kv.uncached(prompt, candidates, uncached, self._pd_min)
        return uncached is not None and uncached < self._pd_min

    def _response(self, request: ProxyRequest) -> Flow:
        assert request.body is not None
        previous = previous_response_id(request.body)
        if previous is not None and self._ids.is_ours(previous):
            request.pinned = self._ids.holder(previous)
            return self.continued_response
        if (adapter := self._adapters.registered(self._model(request))) is not None:
            request.adapter = adapter
            return self.adapter_response
        self.check_routable(self._model(request), MIXED_ROLES)
        return self.new_response

    @staticmethod
    def _model(request: ProxyRequest) -> str:
        assert request.model is not None  # read with the body
        return request.model

    def check_routable(self, model: str, roles: tuple[Role, ...]) -> None:
        """503 when the model is served but nothing of ``roles`` is routable now; 404 when nobody serves it."""
        pool = self._pool
        if any(pool.available(r, model) for r in roles):
            return
        if any(model in s.models for s in pool.all()):
            raise NoNodeAvailable(f"no node is available for model {model!r} right now; retry shortly")
        served = pool.models()
        served = sorted({*served, *(a.name for a in self._adapters.listed(served))})  # registered adapters too
        known = ", ".join(served) or "none"
        raise ModelNotFound(f"The model `{model}` does not exist. Known models: {known}.", param="model")


def _without(avoid: tuple[NodeState, ...], nodes: list[NodeState]) -> list[NodeState]:
    """``nodes`` but those of ``avoid``, unless that leaves none."""
    kept = [s for s in nodes if s not in avoid]
    return kept or nodes
