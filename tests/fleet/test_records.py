"""The etcd key layout and node records: what a registrar, an admin or `etcdctl put` may write."""

from __future__ import annotations

import json

import pytest
from google.protobuf import json_format

from vllm_etcd_proxy.fleet.pb import node_record_pb2
from vllm_etcd_proxy.fleet.records import InvalidRecord, KeyLayout, Role, Sleep, Source, Status, decode_record

LAYOUT = KeyLayout()

INVALID = [
    (b"/vllm/default/gpu/10.0.0.1:8000", b"", "unknown role"),
    (b"/vllm/default/decode/not-a-host-port", b"", "not host:port"),
    (b"/vllm/default/decode/10.0.0.1:8000", b"[1, 2]", "not a JSON object"),
    (b"/vllm/default/decode/10.0.0.1:8000", b"{not json", "not JSON"),
    (b"/vllm/default/decode/10.0.0.1:8000", b'{"url": "ftp://10.0.0.1:8000"}', "not http or https"),
    (b"/vllm/default/decode/10.0.0.1:8000", b'{"url": "http://u:p@10.0.0.1:8000"}', "credentials"),
    (b"/vllm/default/decode/10.0.0.1:8000", b'{"role": "prefill"}', "does not match"),
    (b"/vllm/default/decode/10.0.0.1:8000", b'{"status": "asleep"}', "unknown status"),
    (b"/vllm/default/decode/10.0.0.1:8000", b'{"sleep": "napping"}', "unknown sleep mark"),
    (b"/vllm/default/decode/10.0.0.1:8000", b'{"models": 5}', "not a node record"),
    (b"/vllm/default/decode/10.0.0.1:8000", b"\xff\xfe", "not UTF-8"),
    (b"/vllm/default/decode/\xff:1", b"", "not UTF-8"),
    (b"/vllm/default/decode/10.0.0.1:8000", b"{}" + b" " * 70_000, "bytes"),
    (b"/other/default/decode/10.0.0.1:8000", b"", "is not under"),
    (b"/vllm/default/decode/10.0.0.1:8000", b'{"kv_events": "http://10.0.0.1:5557"}', "kv_events must be tcp"),
    (b"/vllm/default/decode/10.0.0.1:8000", b'{"kv_events": "tcp://*:5557"}', "kv_events must be tcp"),
    (
        b"/vllm/default/decode/10.0.0.1:8000",
        b'{"kvEvents": "tcp://h:5557", "kv_events_replay": "tcp://h"}',
        "kv_events_replay must be tcp",
    ),
]


@pytest.mark.parametrize(("key", "value", "reason"), INVALID)
def test_invalid_keys_and_values_are_refused_with_a_reason(key: bytes, value: bytes, reason: str) -> None:
    with pytest.raises(InvalidRecord, match=reason):
        LAYOUT.parse(key, value)


def test_empty_value_means_http_node_id_serving_models_from_node() -> None:
    node = LAYOUT.parse(b"/vllm/default/decode/10.0.0.7:8200", b"")
    assert node.url == "http://10.0.0.7:8200"
    assert node.role is Role.DECODE
    assert node.status is Status.SERVING
    assert node.learn_models and node.models == ()


def test_ipv6_node_id_with_empty_value() -> None:
    node = LAYOUT.parse(b"/vllm/default/mixed/[::1]:8000", b"")
    assert node.url == "http://[::1]:8000"
    assert node.host_port == "[::1]:8000"


def test_full_record_with_unknown_fields() -> None:
    value = (
        b'{"url": "https://node-a.example:8443/", "role": "prefill", "models": ["m1", "m2", "m1"],'
        b' "status": "draining", "labels": {"zone": "a"}, "future_field": {"x": 1}, "source": "admin"}'
    )
    node = LAYOUT.parse(b"/vllm/default/prefill/node-a", value)
    assert node.url == "https://node-a.example:8443"
    assert node.models == ("m1", "m2")
    assert node.status is Status.DRAINING
    assert node.labels == {"zone": "a"}
    assert node.source is Source.ADMIN
    assert node.host_port == "node-a.example:8443"


def test_cluster_and_prefix_select_the_key_space() -> None:
    layout = KeyLayout(prefix="/fleet/", cluster="east")
    assert layout.cluster_prefix == "/fleet/east/"
    assert layout.key(Role.MIXED, "h:1") == "/fleet/east/mixed/h:1"
    with pytest.raises(InvalidRecord):
        layout.parse(b"/vllm/default/mixed/h:1", b"")


def test_refusal_reasons_never_quote_credentials() -> None:
    with pytest.raises(InvalidRecord) as refused:
        LAYOUT.parse(b"/vllm/default/decode/10.0.0.1:8000", b'{"url": "ftp://admin:hunter2@10.0.0.1:8000"}')
    assert "hunter2" not in str(refused.value)


RECORDS_BOTH_WAYS = [
    {
        "url": "http://127.0.0.5:8100",
        "role": "decode",
        "models": ["a", "b"],
        "status": "draining",
        "labels": {"zone": "a"},
        "version": "1",
        "registered_at": "2025-01-01T00:00:00Z",
        "source": "registrar",
    },
    {"url": "http://127.0.0.5:8100", "registeredAt": "t", "kvConnector": "nixl"},  # proto3 JSON's camelCase names
    {"url": "http://127.0.0.5:8100", "models": "a"},  # not a list: json_format's verdict
    {"url": "http://127.0.0.5:8100", "models": None, "future": {"x": 1}},  # null and an unknown field
    {"url": "http://127.0.0.5:8100", "version": 3},
    {"registered_at": "a", "registeredAt": "b"},  # the same field twice
]
"""Values a registrar writes (decoded without json_format) and values it does not (decoded by json_format)."""


@pytest.mark.parametrize("obj", RECORDS_BOTH_WAYS)
def test_a_record_decodes_as_json_format_decodes_it(obj: dict[str, object]) -> None:
    value = json.dumps(obj).encode()
    try:
        expected = json_format.ParseDict(obj, node_record_pb2.NodeRecord(), ignore_unknown_fields=True)
    except json_format.ParseError:
        with pytest.raises(InvalidRecord):
            decode_record(value)
        return
    assert decode_record(value) == expected


def test_kv_event_endpoints_are_read_in_both_spellings() -> None:
    for value in (
        b'{"kv_events": "tcp://10.0.0.5:5557", "kv_events_replay": "tcp://10.0.0.5:5558"}',
        b'{"kvEvents": "tcp://10.0.0.5:5557", "kvEventsReplay": "tcp://10.0.0.5:5558"}',
    ):
        node = LAYOUT.parse(b"/vllm/default/mixed/10.0.0.5:8000", value)
        assert (node.kv_events, node.kv_events_replay) == ("tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558")
    bare = LAYOUT.parse(b"/vllm/default/mixed/10.0.0.5:8000", b'{"kv_events_replay": "tcp://[::1]:5558"}')
    assert (bare.kv_events, bare.kv_events_replay) == (None, None)  # a replay socket alone says nothing


def test_the_sleep_mark_is_read_and_absent_means_awake() -> None:
    key = b"/vllm/default/mixed/10.0.0.1:8000"
    assert LAYOUT.parse(key, b'{"sleep": "draining"}').sleep is Sleep.DRAINING
    assert LAYOUT.parse(key, b'{"sleep": "asleep", "status": "serving"}').sleep is Sleep.ASLEEP
    assert LAYOUT.parse(key, b"{}").sleep is Sleep.AWAKE and LAYOUT.parse(key, b"").sleep is Sleep.AWAKE
