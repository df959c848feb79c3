"""``vllm-proxy``'s sleep-mode flags: ``--sleep-after-idle [MODEL=]S`` and its bounds, checked before start."""

from __future__ import annotations

import pytest

from vllm_etcd_proxy.proxy.cli import parse_settings

NODE = ["--mixed", "127.0.0.1:8100"]
BAD = {
    "not seconds": (["--sleep-after-idle", "soon"], "--sleep-after-idle"),
    "no model": (["--sleep-after-idle", "=30"], "--sleep-after-idle"),
    "zero": (["--sleep-after-idle", "m=0"], "--sleep-after-idle"),
    "negative min-awake": (["--min-awake", "-1"], "--min-awake"),
    "zero wake timeout": (["--wake-timeout", "0"], "--wake-timeout"),
    "sleep level 3": (["--sleep-level", "3"], "--sleep-level"),
}


@pytest.mark.parametrize(("argv", "named"), list(BAD.values()), ids=list(BAD))
def test_bad_sleep_flags_are_usage_errors_naming_the_flag(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_settings([*NODE, *argv])
    assert exited.value.code == 2
    assert named in capsys.readouterr().err


def test_idle_times_are_read_per_model_and_for_every_other_model() -> None:
    settings = parse_settings([*NODE, "--sleep-after-idle", "300", "org/big-model=60", "--wake-on-demand"])
    assert settings.sleep_after_idle == (("", 300.0), ("org/big-model", 60.0))
    assert (settings.wake_on_demand, settings.wake_timeout, settings.min_awake, settings.sleep_level) == (
        True,
        60.0,
        1,
        1,
    )
