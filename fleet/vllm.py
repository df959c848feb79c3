"""What a vLLM node says about itself, read alike by the proxy and the registrar: the models it serves
(``GET /v1/models``) and its load and speed (``GET /metrics``).

The load is read with a regular expression rather than a full Prometheus parser: vLLM's page is large and
scraped often. Each pattern starts with the literal ``\nvllm:`` (the page is searched with a newline in front),
which lets the regex engine skip ahead to candidate lines: six times faster than a ``^`` anchor in multiline
mode, which tries every position of the page.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

RUNNING, WAITING = "vllm:num_requests_running", "vllm:num_requests_waiting"
_ITL = re.compile(
    rb"\nvllm:(inter_token_latency_seconds|time_per_output_token_seconds)_(sum|count)(?:\{[^}\n]*\})?[ \t]+(\S+)"
)
_GAUGES = re.compile(
    rb"\nvllm:(num_requests_running|num_requests_waiting|kv_cache_usage_perc)(?:\{[^}\n]*\})?[ \t]+(\S+)"
)


_AWAKE = re.compile(rb'\nvllm:engine_sleep_state\{[^}\n]*sleep_state="awake"[^}\n]*\}[ \t]+(\S+)')


def read_asleep(text: bytes) -> bool | None:
    """True when every engine of the node is asleep (``vllm:engine_sleep_state{sleep_state="awake"}`` 0, after
    ``POST /sleep``), False when one is awake, None when the page does not say (older vLLM)."""
    values = []
    for value in _AWAKE.findall(b"\n" + text):
        try:
            values.append(float(value))
        except ValueError:
            continue
    return None if not values else max(values) == 0


def read_node_load(text: bytes) -> tuple[int, int, float] | None:
    """(running, waiting, KV-cache usage) from a vLLM /metrics page, summed over engines (usage: the highest);
    None when the page has none of them."""
    running = waiting = 0.0
    usage = 0.0
    seen = False
    for name, value in _GAUGES.findall(b"\n" + text):
        try:
            number = float(value)
        except ValueError:
            continue
        if number != number:  # NaN
            continue
        seen = True
        if name == b"num_requests_running":
            running += number
        elif name == b"num_requests_waiting":
            waiting += number
        else:
            usage = max(usage, number)
    return (int(running), int(waiting), usage) if seen else None


def read_token_latency(text: bytes) -> tuple[float, float] | None:
    """(sum of seconds, count) of the inter-token latency histogram, summed over engines; vLLM's older name
    ``vllm:time_per_output_token_seconds`` when the page has no ``vllm:inter_token_latency_seconds``."""
    found: dict[bytes, list[float]] = {}
    for name, part, value in _ITL.findall(b"\n" + text):
        try:
            number = float(value)
        except ValueError:
            continue
        if number == number:
            totals = found.setdefault(name, [0.0, 0.0])
            totals[part == b"count"] += number
    chosen = found.get(b"inter_token_latency_seconds") or found.get(b"time_per_output_token_seconds")
    return (chosen[0], chosen[1]) if chosen else None


ModelCard = Mapping[str, Any]
"""One entry of a node's GET /v1/models, as the node gave it (``id``, ``root``, ``parent``, ``max_model_len``...)."""


def parse_model_cards(body: Any) -> tuple[ModelCard, ...]:
    """The entries of an OpenAI model list (``{"data": [{"id": ...}, ...]}``), in order, one per id; raises
    ``ValueError`` naming what is wrong when the body is not such a list."""
    if not isinstance(body, dict) or not isinstance(body.get("data"), list):
        raise ValueError("/v1/models is not an OpenAI model list")
    cards: dict[str, ModelCard] = {}
    for entry in body["data"]:
        model_id = entry.get("id") if isinstance(entry, dict) else None
        if not isinstance(model_id, str) or not model_id:
            raise ValueError("/v1/models has an entry without an id")
        cards.setdefault(model_id, plain_numbers(entry))
    return tuple(cards.values())


def parse_models(body: Any) -> tuple[str, ...]:
    """Model ids from an OpenAI list, in order, without duplicates (see ``parse_model_cards``)."""
    return tuple(card["id"] for card in parse_model_cards(body))


def plain_numbers(value: Any) -> Any:
    """``value`` with every integral float made an int (protobuf's Struct holds all numbers as doubles, so a
    card that went through a node record says ``4096.0`` where the node said ``4096``)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if isinstance(value, dict):
        return {k: plain_numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_numbers(v) for v in value]
    return value
