"""``engine: nvrx``: the configuration maps onto an NVRx Wrapper that NVRx itself accepts."""

from __future__ import annotations

import pytest

from resilient.config import load_config
from resilient.errors import ConfigError

inprocess = pytest.importorskip("nvidia_resiliency_ext.inprocess")


@pytest.mark.parametrize("hang", [0.5, 2.0, 60.0, 900.0])
def test_timeouts_map_to_a_wrapper_nvrx_accepts(hang: float) -> None:
    from resilient.runtime.engine.nvrx import wrapper_kwargs

    kw = wrapper_kwargs(load_config(None, hang_timeout=hang, engine="nvrx"))
    assert kw["soft_timeout"].total_seconds() == hang
    # NVRx's own checks (soft < hard < barrier, intervals below the timeouts) run in its constructor
    inprocess.Wrapper(**kw)
    # its monitor process checks timeouts only when no watchdog timestamp arrived for an interval
    assert kw["monitor_process_interval"] < kw["progress_watchdog_interval"]


def test_bad_engine_names_the_field() -> None:
    with pytest.raises(ConfigError) as ei:
        load_config(None, engine="torchft")
    assert "engine" in str(ei.value) and "torchft" in str(ei.value)


def test_durable_checkpoints_under_nvrx_are_refused_with_the_reason(tmp_path, monkeypatch) -> None:
    from resilient.launch_env import LaunchEnv
    from resilient.runtime.engine.nvrx import NvrxEngine
    from resilient.runtime.run.wiring import Setup

    cfg = load_config(None, engine="nvrx", checkpoint={"dir": tmp_path})
    with pytest.raises(ConfigError, match="engine: nvrx does not write durable checkpoints"):
        NvrxEngine(Setup.of(cfg, launch=LaunchEnv.from_environ({})))
