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


_PREFIX_CACHE = re.compile(rb"\nvllm:prefix_cache_(hits|queries)_total(?:\{[^}\n]*\})?[ \t]+(\S+)")


def read_prefix_cache(text: bytes) -> tuple[float, float] | None:
    """(hits, queries) of the node's prefix cache, in tokens, summed over engines (counters since its start);
    None when the page has neither (prefix caching off, or an older vLLM)."""
    totals = [0.0, 0.0]
    seen = False
    for part, value in _PREFIX_CACHE.findall(b"\n" + text):
        try:
            number = float(value)
        except ValueError:
            continue
        if number == number:
            seen = True
            totals[part == b"queries"] += number
    return (totals[0], totals[1]) if seen else None


_FINISHED = re.compile(rb"\nvllm:request_success_total(?:\{[^}\n]*\})?[ \t]+(\S+)")


def read_finished(text: bytes) -> float | None:
    """Requests the node finished since it started (``vllm:request_success_total``, summed over engines and
    finish reasons); None when the page has none."""
    total, seen = 0.0, False
    for value in _FINISHED.findall(b"\n" + text):
        try:
            number = float(value)
        except ValueError:
            continue
        if number == number:
            total, seen = total + number, True
    return total if seen else None


_LORA_INFO = re.compile(rb"\nvllm:lora_requests_info\{([^}\n]*)\}[ \t]+(\S+)")
_LABEL = re.compile(rb'(\w+)="([^"\n]*)"')


def read_lora_info(text: bytes) -> tuple[frozenset[str], frozenset[str], int | None] | None:
    """(adapters running, adapters waiting, ``max_lora``) from the newest ``vllm:lora_requests_info`` series (its
    value is when it was last set: older label sets stay on the page); None when the page has none (no LoRA)."""
    newest: tuple[float, bytes] | None = None
    for labels, value in _LORA_INFO.findall(b"\n" + text):
        try:
            stamp = float(value)
        except ValueError:
            continue
        if newest is None or stamp > newest[0]:
            newest = (stamp, labels)
    if newest is None:
        return None
    found = {k.decode(): v.decode("utf-8", "replace") for k, v in _LABEL.findall(newest[1])}

    def names(label: str) -> frozenset[str]:
        return frozenset(n.strip() for n in found.get(label, "").split(",") if n.strip())

    slots = found.get("max_lora", "")
    return names("running_lora_adapters"), names("waiting_lora_adapters"), int(slots) if slots.isdigit() else None


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


VOLATILE_CARD_FIELDS = frozenset({"created", "id"})
"""What vLLM makes anew on every GET /v1/models: ``created`` (now) on a card and on each of its ``permission``
entries, and each permission's ``id`` (random)."""


def stable_card(card: Any) -> Any:
    """A model card without what changes from one GET /v1/models to the next (``VOLATILE_CARD_FIELDS``), its
    numbers plain: what tells whether a node's cards really changed."""
    plain = plain_numbers(card)
    if not isinstance(plain, dict):
        return plain
    found = {k: v for k, v in plain.items() if k != "created"}
    permissions = found.get("permission")
    if isinstance(permissions, list):
        found["permission"] = [
            {k: v for k, v in p.items() if k not in VOLATILE_CARD_FIELDS} if isinstance(p, dict) else p
            for p in permissions
        ]
    return found


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
