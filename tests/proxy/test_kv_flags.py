"""``vllm-proxy --kv-events NODE=ENDPOINT[,REPLAY]``: static nodes' KV-event publishers, checked before start."""

from __future__ import annotations

import pytest

from vllm_etcd_proxy.proxy.cli import parse_settings

BAD = {
    "no endpoint": ["--mixed", "127.0.0.1:8100", "--kv-events", "127.0.0.1:8100"],
    "not tcp": ["--mixed", "127.0.0.1:8100", "--kv-events", "127.0.0.1:8100=ipc:///tmp/kv"],
    "bad replay": ["--mixed", "127.0.0.1:8100", "--kv-events", "127.0.0.1:8100=tcp://127.0.0.1:5557,tcp://x"],
    "unknown node": ["--mixed", "127.0.0.1:8100", "--kv-events", "127.0.0.1:8101=tcp://127.0.0.1:5557"],
}


@pytest.mark.parametrize("argv", list(BAD.values()), ids=list(BAD))
def test_bad_kv_events_flags_are_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_settings(argv)
    assert exited.value.code == 2
    assert "--kv-events" in capsys.readouterr().err


def test_kv_events_flag_names_a_static_node_by_its_address() -> None:
    settings = parse_settings(
        ["--mixed", "127.0.0.1:8100", "--kv-events", "127.0.0.1:8100=tcp://127.0.0.1:5557,tcp://127.0.0.1:5558"]
    )
    assert settings.kv_events == (("127.0.0.1:8100", "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558"),)
