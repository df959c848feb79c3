"""What a request's path is to the proxy: its own route, a node-admin route it refuses, or one it forwards (and
how: the generate flow, the Responses API, by response id, or plainly by model).

vLLM serves many routes besides chat and completions (embeddings, pooling, rerank, score, classify, audio,
Anthropic messages, tokens in and out, ``/tokenize``, GET routes such as ``/version``); every path that is not
the proxy's own and not node-admin is forwarded to a node serving the request's model, so a route vLLM adds
tomorrow works through the proxy without a change here.
"""

from __future__ import annotations

import re
from enum import Enum


class Kind(Enum):
    OWN = "own"
    """Answered by this replica (health, status, metrics, the merged model list, the admin API)."""
    NODE_ADMIN = "node_admin"
    """Acts on one vLLM node (sleep, adapters, cache resets, profiling): never sent to a node picked by load."""
    GENERATE = "generate"
    """Completions and chat completions: the disaggregated flow where the model has prefill and decode nodes."""
    RESPONSES = "responses"
    """``POST /v1/responses``: a new response, whose id names the node that keeps it."""
    BY_RESPONSE_ID = "by_response_id"
    """``/v1/responses/{id}...``: to the node that holds that response."""
    FORWARD = "forward"
    """Anything else: to a node serving the request's model, byte for byte."""
    SESSION = "session"
    """A WebSocket session (any path): one node per connection, message by message (sessions.py)."""


OWN_PATHS = frozenset(
    [
        "/health",
        "/ready",
        "/status",
        "/metrics",
        "/list_models",
        "/list_workers",
        "/v1/models",
        "/instances/add",
        "/instances/remove",
        "/dashboard",
    ]
)
NODE_ADMIN_PATHS = frozenset(
    [
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
        "/sleep",
        "/wake_up",
        "/is_sleeping",
        "/reset_prefix_cache",
        "/reset_mm_cache",
        "/reset_encoder_cache",
        "/start_profile",
        "/stop_profile",
        "/collective_rpc",
        "/scale_elastic_ep",
        "/is_scaling_elastic_ep",
        "/pause",
        "/resume",
        "/is_paused",
        "/update_weights",
        "/server_info",
        "/init_weight_transfer",
        "/update_weights_from_disk",
    ]
)
"""vLLM's routes that change or inspect one node's engine (most exist only in its dev mode or with an env flag)."""
GENERATE_PATHS = frozenset(["/v1/completions", "/v1/chat/completions"])
RESPONSES_PATH = "/v1/responses"
_BY_ID = re.compile(r"^/v1/responses/([^/]{1,256})(/[a-z_]{1,32})?$")
MODEL_CARD_PREFIX = "/v1/models/"
ADMIN_PREFIX = "/admin/"
"""The replica's node operations (operations/nodeops.py)."""

METRIC_ROUTES = frozenset(
    [
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/embeddings",
        "/v1/score",
        "/v1/rerank",
        "/v1/responses",
        "/v1/audio/transcriptions",
        "/v1/audio/translations",
        "/v1/pooling",
        "/v1/classify",
        "/tokenize",
        "/detokenize",
        "/v1/messages",
        "/rerank",
        "/score",
        "/pooling",
        "/classify",
        "/v2/rerank",
        "/v2/embed",
        "/inference/v1/generate",
        "/version",
        "/tokenizer_info",
        "/v1/realtime",
    ]
)
"""Routes named as such in metrics; any other forwarded path counts as ``other`` (bounded label values)."""
BY_ID_ROUTE = "/v1/responses/{id}"


def classify(path: str) -> Kind:
    """The kind of ``path`` (any method; a wrong method on one of the proxy's own routes gets its 405 there)."""
    if path in OWN_PATHS or path.startswith(MODEL_CARD_PREFIX) or path.startswith(ADMIN_PREFIX):
        return Kind.OWN
    if path in NODE_ADMIN_PATHS:
        return Kind.NODE_ADMIN
    if path in GENERATE_PATHS:
        return Kind.GENERATE
    if path == RESPONSES_PATH:
        return Kind.RESPONSES
    if path.startswith("/v1/responses/") and _BY_ID.match(path):
        return Kind.BY_RESPONSE_ID
    return Kind.FORWARD


def response_id_of(path: str) -> str:
    """The id in ``/v1/responses/{id}`` or ``/v1/responses/{id}/cancel`` (``classify`` said BY_RESPONSE_ID)."""
    match = _BY_ID.match(path)
    assert match is not None
    return match.group(1)


def metric_route(path: str, kind: Kind) -> str:
    if kind is Kind.BY_RESPONSE_ID:
        return BY_ID_ROUTE
    return path if path in METRIC_ROUTES else "/v1/other"
