"""Both programs read flags and environment alike: the command line wins, lists replace, one password source."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_etcd_proxy.proxy.cli import parse_settings
from vllm_etcd_proxy.registrar.cli import parse_command_line
from vllm_etcd_proxy.registrar.errors import UsageError

REGISTRAR = ["--etcd", "http://127.0.0.1:2379", "--role", "mixed", "--url", "http://127.0.0.1:8001"]
PROXY = ["--etcd", "http://127.0.0.1:2379"]


def test_a_flag_on_the_command_line_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_PROXY_CLUSTER", "from-env")
    monkeypatch.setenv("VLLM_REGISTRAR_CLUSTER", "from-env")
    assert parse_settings([*PROXY, "--cluster", "from-flag"]).cluster == "from-flag"
    assert parse_command_line([*REGISTRAR, "--cluster=from-flag"])[0].cluster == "from-flag"
    assert parse_settings(PROXY).cluster == "from-env"
    assert parse_command_line(REGISTRAR)[0].cluster == "from-env"


def test_a_list_flag_on_the_command_line_replaces_the_environments_list(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_PROXY_MODEL", "env-a,env-b")
    monkeypatch.setenv("VLLM_REGISTRAR_LABEL", "zone=env,rack=env")
    assert parse_settings(PROXY).models == ("env-a", "env-b")
    assert parse_settings([*PROXY, "--model", "flag-a"]).models == ("flag-a",)
    assert parse_command_line(REGISTRAR)[0].labels == {"zone": "env", "rack": "env"}
    assert parse_command_line([*REGISTRAR, "--label", "zone=flag"])[0].labels == {"zone": "flag"}


def test_the_etcd_password_comes_from_one_source_in_both_programs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    secret = tmp_path / "password"
    secret.write_text("from-file\n")
    both_file = ["--etcd-user", "u", "--etcd-password-file", str(secret)]
    proxy = parse_settings([*PROXY, *both_file])
    assert proxy.etcd is not None and proxy.etcd.password == "from-file"
    assert parse_command_line([*REGISTRAR, *both_file])[0].etcd.password == "from-file"

    monkeypatch.setenv("VLLM_PROXY_ETCD_PASSWORD", "from-env")
    monkeypatch.setenv("VLLM_REGISTRAR_ETCD_PASSWORD", "from-env")
    with pytest.raises(SystemExit) as exited:
        parse_settings([*PROXY, *both_file])
    assert exited.value.code == 2
    assert "not both" in capsys.readouterr().err
    with pytest.raises(UsageError, match="not both"):
        parse_command_line([*REGISTRAR, *both_file])


def test_the_simulated_node_reads_its_environment_the_same_way() -> None:
    from vllm_etcd_proxy.sim.cli import parse_settings as sim_settings

    env = {"VLLM_SIM_MODEL": "a,b", "VLLM_SIM_HANG": "0", "VLLM_SIM_TTFT": "0.25"}
    settings = sim_settings([], env)
    assert settings.models == ("a", "b") and settings.hang is False and settings.ttft == 0.25
    settings = sim_settings(["--model", "c", "--ttft", "0"], {**env, "VLLM_SIM_HANG": "yes"})
    assert settings.models == ("c",) and settings.hang is True and settings.ttft == 0.0


def test_both_programs_take_the_silence_bound_and_keepalive_from_flags_or_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    proxy = parse_settings(PROXY).etcd
    registrar = parse_command_line(REGISTRAR)[0].etcd
    assert proxy is not None and proxy == registrar  # the same defaults in both programs
    assert (proxy.dead_after, proxy.keepalive_time, proxy.keepalive_timeout) == (3.0, 10.0, 5.0)

    monkeypatch.setenv("VLLM_PROXY_ETCD_DEAD_AFTER", "1.5")
    monkeypatch.setenv("VLLM_REGISTRAR_ETCD_DEAD_AFTER", "1.5")
    flags = ["--etcd-keepalive-time", "6", "--etcd-keepalive-timeout", "2"]
    proxy = parse_settings([*PROXY, *flags]).etcd
    registrar = parse_command_line([*REGISTRAR, *flags])[0].etcd
    assert proxy is not None and proxy == registrar
    assert (proxy.dead_after, proxy.keepalive_time, proxy.keepalive_timeout) == (1.5, 6.0, 2.0)

    with pytest.raises(SystemExit):
        parse_settings([*PROXY, "--etcd-keepalive-time", "2"])  # etcd would answer GOAWAY too_many_pings
    assert "keepalive_time" in capsys.readouterr().err
    with pytest.raises(UsageError, match="--etcd-keepalive-time"):
        parse_command_line([*REGISTRAR, "--etcd-keepalive-time", "2"])
    with pytest.raises(UsageError, match="--etcd-dead-after"):
        parse_command_line([*REGISTRAR, "--etcd-dead-after", "0"])


def test_the_proxys_background_rates_and_burst_pause_come_from_flags_and_must_be_positive(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    defaults = parse_settings(PROXY)
    assert (defaults.scrape_rate, defaults.models_probe_rate, defaults.ejection.probe_rate) == (250.0, 20.0, 20.0)
    assert defaults.etcd is not None and defaults.etcd.burst_pause == 0.2
    monkeypatch.setenv("VLLM_PROXY_SCRAPE_RATE", "40")
    flags = ["--models-probe-rate", "5", "--eject-probe-rate", "2", "--etcd-burst-pause", "0"]
    settings = parse_settings([*PROXY, *flags])
    assert (settings.scrape_rate, settings.models_probe_rate, settings.ejection.probe_rate) == (40.0, 5.0, 2.0)
    assert settings.etcd is not None and settings.etcd.burst_pause == 0.0
    for flag in ("--scrape-rate", "--models-probe-rate", "--eject-probe-rate"):
        with pytest.raises(SystemExit):
            parse_settings([*PROXY, flag, "0"])
        assert f"{flag} must be more than 0" in capsys.readouterr().err
