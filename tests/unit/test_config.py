"""Configuration: defaults, the shipped YAML, error messages, overrides and derived timeouts."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from resilient.config import Config, RestartConfig, Timeouts, load_config
from resilient.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_YAML = ROOT / "configs" / "default.yaml"


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "job.yaml"
    p.write_text(text)
    return p


def test_defaults_validate():
    cfg = load_config()
    assert cfg == Config()
    assert cfg.hang_timeout > 0
    assert cfg.restart.backoff_max_s >= cfg.restart.backoff_initial_s
    assert cfg.interrupt_signal == "SIGUSR2"


def test_default_yaml_mirrors_the_model_defaults():
    assert load_config(DEFAULT_YAML) == Config()


def test_bad_value_in_yaml_names_file_field_and_value(tmp_path: Path):
    p = write(tmp_path, "restart:\n  max_recoveries: -7\n")
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    msg = str(ei.value)
    assert str(p) in msg
    assert "restart.max_recoveries" in msg
    assert "-7" in msg


def test_unknown_key_is_named(tmp_path: Path):
    p = write(tmp_path, "restart:\n  max_restart: 5\n")
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    msg = str(ei.value)
    assert "unknown field" in msg
    assert "restart.max_restart" in msg
    assert str(p) in msg


def test_the_old_name_of_max_recoveries_is_read_with_a_warning(tmp_path: Path):
    p = write(tmp_path, "restart:\n  max_restarts: 4\n")
    with pytest.warns(DeprecationWarning, match="restart.max_recoveries"):
        assert load_config(p).restart.max_recoveries == 4
    both = write(tmp_path, "restart:\n  max_restarts: 4\n  max_recoveries: 5\n")
    with pytest.raises(ConfigError, match="give one of them"):
        load_config(both)


def test_the_old_name_of_the_store_copys_budget_is_read_with_a_warning(tmp_path: Path):
    p = write(tmp_path, "snapshot:\n  replica_max_bytes: 4096\n")
    with pytest.warns(DeprecationWarning, match="snapshot.store_copy_max_bytes"):
        assert load_config(p).snapshot.store_copy_max_bytes == 4096


def test_keyword_overrides_merge_into_nested_sections(tmp_path: Path):
    p = write(tmp_path, "hang_timeout: 5\nrestart:\n  max_recoveries: 4\n  window_s: 100\n")
    cfg = load_config(p, restart={"max_repeats": 2}, snapshot={"interval": 3})
    # the override adds to the file's section instead of replacing it
    assert cfg.restart.max_recoveries == 4
    assert cfg.restart.window_s == 100.0
    assert cfg.restart.max_repeats == 2
    assert cfg.snapshot.interval == 3
    assert cfg.hang_timeout == 5.0
    # untouched fields of the section keep their defaults
    assert cfg.restart.backoff_max_s == RestartConfig().backoff_max_s


def test_error_names_the_source_of_the_bad_value(tmp_path: Path):
    p = write(tmp_path, "hang_timeout: 5\nrestart:\n  max_recoveries: -2\n")
    with pytest.raises(ConfigError) as ei:
        load_config(p, hang_timeout=0, backend="gloo")
    msg = str(ei.value)
    assert "keyword override: hang_timeout = 0:" in msg  # the override is blamed, not the file
    assert f"{p}: restart.max_recoveries = -2:" in msg  # the file's own bad value names the file


@pytest.mark.parametrize("hang", [0.01, 0.5, 1.0, 4.0, 60.0, 3600.0])
def test_derived_timeouts_are_ordered(hang: float):
    t = Config(hang_timeout=hang).timeouts
    assert t.hang == hang
    assert t.hang < t.hard < t.barrier
    assert t.startup >= t.hang
    assert t.collective == 2.0 * hang
    assert t.barrier > t.collective
    assert 0 < t.monitor_interval <= t.hang / 10
    assert 0 < t.victim_grace < t.hang
    assert t.hang + t.victim_grace <= t.hard  # a victim's deferred hang still precedes the backstop


def test_explicit_collective_timeout_is_kept():
    t = Config(hang_timeout=10, collective_timeout=300).timeouts
    assert t.collective == 300.0
    assert t.hang < t.hard < t.barrier
    assert t.barrier > t.collective
    assert Timeouts.derive(10.0, None).collective == 20.0


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSTOP", "NOT_A_SIGNAL"])
def test_unusable_interrupt_signal_rejected(sig: str):
    with pytest.raises(ConfigError) as ei:
        load_config(interrupt_signal=sig)
    assert "interrupt_signal" in str(ei.value) and sig in str(ei.value)


def test_missing_file_error_names_the_path(tmp_path: Path):
    p = tmp_path / "nope" / "missing.yaml"
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    assert str(p) in str(ei.value)


def test_a_relative_config_path_not_found_names_the_directory_it_was_read_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.chdir(tmp_path)  # (a user's project, where the repository's configs/ is not)
    with pytest.raises(ConfigError) as ei:
        load_config("configs/default.yaml")
    message = str(ei.value)
    assert "\n" not in message and str(tmp_path / "configs" / "default.yaml") in message
    assert "leave config out" in message


def test_backoff_max_below_initial_rejected():
    with pytest.raises(ConfigError) as ei:
        load_config(restart={"backoff_initial_s": 5.0, "backoff_max_s": 1.0})
    assert "backoff_max_s" in str(ei.value)


def test_non_mapping_yaml_rejected(tmp_path: Path):
    p = write(tmp_path, "- just\n- a list\n")
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    assert str(p) in str(ei.value) and "mapping" in str(ei.value)


def test_unknown_health_check_rejected():
    with pytest.raises(ConfigError) as ei:
        load_config(health={"checks": ["gpu", "disk_speed"]})
    assert "disk_speed" in str(ei.value)


def test_config_is_frozen():
    cfg = Config()
    with pytest.raises(ValidationError):
        cfg.hang_timeout = 1.0  # type: ignore[misc]


@pytest.mark.parametrize("name", ["SIG_IGN", "SIG_DFL", "NSIG", "getsignal"])
def test_non_signal_attribute_names_rejected(name: str):
    with pytest.raises(ConfigError):
        load_config(interrupt_signal=name)


def test_bad_list_element_value_is_shown():
    with pytest.raises(ConfigError) as ei:
        load_config(health={"checks": ["gpu", 7]})
    assert "health.checks.1 = 7" in str(ei.value)
