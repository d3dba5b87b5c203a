"""Where step hooks come from: entry points, then ``RESILIENT_HOOKS``; a broken one is named and
skipped. And the chaos harness names its hook only in a chaos job's environment."""

from __future__ import annotations

import sys
import types
from importlib.metadata import EntryPoint
from typing import Any

import pytest

from resilient.launch_env import LaunchEnv
from resilient.runtime import hooks
from resilient.runtime.hooks import ENTRY_POINT_GROUP, Hook


class _Named(Hook):
    def __init__(self, name: str) -> None:
        self.name = name


@pytest.fixture
def plugins(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """An importable module of hook factories (one that works, one inactive, one broken) and one
    installed entry point, ``ep:installed``."""
    mod = types.ModuleType("fake_hooks")
    mod.named = lambda: _Named("from env")  # type: ignore[attr-defined]
    mod.inactive = lambda: None  # type: ignore[attr-defined]
    mod.broken = lambda: 1 / 0  # type: ignore[attr-defined]
    mod.installed = lambda: _Named("entry point")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_hooks", mod)
    ep = EntryPoint(name="installed", value="fake_hooks:installed", group=ENTRY_POINT_GROUP)
    monkeypatch.setattr(hooks, "entry_points", lambda group: [ep] if group == ENTRY_POINT_GROUP else [])
    return mod


def _names(found: list[Any]) -> list[str]:
    return [h.name for h in found]


def test_the_variable_s_factories_load_after_the_entry_points(plugins: types.ModuleType) -> None:
    launch = LaunchEnv.from_environ({"RESILIENT_HOOKS": " fake_hooks:named , fake_hooks:inactive,"})
    assert launch.hooks == ("fake_hooks:named", "fake_hooks:inactive")
    assert _names(hooks.discover(launch)) == ["entry point", "from env"]  # inactive: None, left out


def test_a_factory_named_twice_loads_once(plugins: types.ModuleType) -> None:
    names = "fake_hooks:installed,fake_hooks:named,fake_hooks:named"  # (installed: an entry point too)
    launch = LaunchEnv.from_environ({"RESILIENT_HOOKS": names})
    assert _names(hooks.discover(launch)) == ["entry point", "from env"]


def test_a_broken_factory_is_named_and_skipped(plugins: types.ModuleType) -> None:
    from loguru import logger

    warnings: list[str] = []
    sink = logger.add(warnings.append, level="WARNING", format="{message}")
    try:
        names = "fake_hooks:broken,no_such_module:factory,fake_hooks:missing,fake_hooks:named"
        found = hooks.discover(LaunchEnv.from_environ({"RESILIENT_HOOKS": names}))
    finally:
        logger.remove(sink)
    assert _names(found) == ["entry point", "from env"]
    assert len(warnings) == 3
    assert "fake_hooks:broken" in warnings[0] and "ZeroDivisionError" in warnings[0]
    assert "no_such_module:factory" in warnings[1] and "ModuleNotFoundError" in warnings[1]
    assert "fake_hooks:missing" in warnings[2] and "AttributeError" in warnings[2]


def test_no_variable_no_extra_hooks(plugins: types.ModuleType) -> None:
    assert LaunchEnv.from_environ({}).hooks == ()
    assert _names(hooks.discover(LaunchEnv.from_environ({}))) == ["entry point"]


def test_the_chaos_harness_names_its_hook_only_for_a_chaos_job() -> None:
    from chaos.hooks import FACTORY, enable

    assert enable({"PATH": "/bin"}) == {"PATH": "/bin"}  # no chaos variable: nothing to load
    assert enable({"CHAOS_PLAN": ""}) == {"CHAOS_PLAN": ""}
    env = enable({"CHAOS_FINAL_STATE": "/tmp/s", "RESILIENT_HOOKS": "mine:hook"})
    assert env["RESILIENT_HOOKS"] == f"mine:hook,{FACTORY}"  # the user's hooks stay, first
    assert enable(dict(env))["RESILIENT_HOOKS"] == env["RESILIENT_HOOKS"]  # named once
    assert FACTORY == "chaos.hooks:from_env"
