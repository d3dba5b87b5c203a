"""``resilient launch --fault``: the harness's plan reaches a plain launch's workers through its
entry point (the launcher never imports the harness), and a plan that does not parse is refused
before any worker starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from chaos.hooks import FACTORY, from_env
from chaos.plugin import plan_env
from resilient.launcher.cli import fault_plan, parse


def test_the_plan_names_the_hook_the_plan_and_where_firings_are_recorded(tmp_path: Path) -> None:
    env = plan_env("exception@12:1,hang@20:0", str(tmp_path / "inj.jsonl"), {"RESILIENT_HOOKS": "mine:hook"})
    assert env["CHAOS_PLAN"] == "exception@12:1,hang@20:0"
    assert env["CHAOS_INJECTIONS"] == str(tmp_path / "inj.jsonl")
    assert env["RESILIENT_HOOKS"] == f"mine:hook,{FACTORY}"  # (the user's own hooks stay first)
    hook = from_env(env)  # what a worker builds from it: an injector with the two faults
    assert hook is not None and hook.injector is not None
    assert [(f.kind, f.step, f.rank) for f in hook.injector.faults] == [("exception", 12, 1), ("hang", 20, 0)]


def test_the_launcher_finds_the_harness_and_refuses_a_bad_plan_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args, p = parse(["--standalone", "--fault", "oom@8:1", "--fault", "exception@3", "train.py"])
    assert args.fault == ["oom@8:1", "exception@3"]
    env = fault_plan(p, ",".join(args.fault), tmp_path / "inj.jsonl")
    assert env["CHAOS_PLAN"] == "oom@8:1,exception@3"
    with pytest.raises(SystemExit) as ei:
        fault_plan(p, "explode@3", tmp_path / "inj.jsonl")
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert "argument --fault: bad fault spec 'explode@3'" in err and "exception" in err
