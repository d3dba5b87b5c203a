"""``engine: nvrx`` without the ``nvrx`` extra: one line that names the extra, at construction."""

from __future__ import annotations

import sys

import pytest

from resilient.config import load_config
from resilient.errors import ConfigError


def test_engine_nvrx_without_nvidia_resiliency_ext_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from resilient.launch_env import LaunchEnv
    from resilient.runtime.engine.nvrx import NvrxEngine
    from resilient.runtime.run.wiring import Setup

    for name in [m for m in sys.modules if m.startswith("nvidia_resiliency_ext")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "nvidia_resiliency_ext", None)  # (an import of it raises ImportError)
    cfg = load_config(None, engine="nvrx")
    with pytest.raises(ConfigError) as ei:
        NvrxEngine(Setup.of(cfg, launch=LaunchEnv.from_environ({})))
    message = str(ei.value)
    assert "pip install 'resilient[nvrx]'" in message and "\n" not in message
    with pytest.raises(ConfigError, match=r"resilient\[nvrx\]"):  # at decoration, before any rank starts
        import resilient

        resilient.wrap(engine="nvrx")


def test_a_plain_import_pulls_no_nvrx() -> None:
    import subprocess

    code = "import resilient, sys; print(any(m.startswith('nvidia_resiliency_ext') for m in sys.modules))"
    done = subprocess.run(
        [sys.executable, "-W", "error::FutureWarning", "-c", code], capture_output=True, text=True
    )
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr[-2000:]
