"""Warm standbys: what a dead worker's command becomes in a standby, and a real promotion."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from resilient.launcher.standby import Standby, Target, target


@pytest.mark.parametrize(
    ("entry", "args", "want"),
    [
        (sys.executable, ["-u", "train.py", "--steps", "4"], Target(False, "train.py", ("--steps", "4"))),
        (sys.executable, ["train.py"], Target(False, "train.py", ())),
        ("/usr/bin/python3", ["-u", "-m", "pkg.train", "-x"], Target(True, "pkg.train", ("-x",))),
        (sys.executable, ["-u", "-X", "dev", "train.py"], None),  # interpreter options it cannot replay
        (sys.executable, ["-u", "-m"], None),
        ("/opt/bin/launcher.sh", ["train.py"], None),  # --no-python: not a Python entry point
    ],
)
def test_only_a_plain_python_command_is_promoted(entry: str, args: list[str], want: Target | None) -> None:
    assert target(entry, args) == want


def test_a_promoted_standby_runs_the_script_as_python_would(tmp_path: Path, wait_until: Any) -> None:
    script = tmp_path / "job" / "train.py"
    script.parent.mkdir()
    out = tmp_path / "seen.json"
    script.write_text(
        "import json, os, sys\n"
        "seen = {'name': __name__, 'argv': sys.argv, 'path0': sys.path[0], 'rank': os.environ['RANK'],\n"
        "        'stdin': sys.stdin.read(), 'torch': 'torch' in sys.modules}\n"
        f"json.dump(seen, open({str(out)!r}, 'w'))\n"
        "sys.exit(7)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    sb = Standby(env, tmp_path)
    try:
        wait_until(sb.ready, 120, "the standby to finish its imports")
        sb.promote(1, {**env, "RANK": "3"}, Target(False, str(script), ("--steps", "4")), None, None)
        assert sb.proc.wait(60) == 7  # the script's own exit code
    finally:
        sb.close()
        sb.proc.wait(10)
    seen = json.loads(out.read_text())
    assert seen == {
        "name": "__main__",
        "argv": [str(script), "--steps", "4"],
        "path0": str(script.parent),
        "rank": "3",  # the dead rank's environment, not the standby's
        "stdin": "",  # not the order pipe
        "torch": True,  # imported while it waited
    }
    assert not list(tmp_path.glob("standby-*.ready"))


def test_a_standby_whose_order_never_comes_exits_quietly(tmp_path: Path, wait_until: Any) -> None:
    sb = Standby({**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}, tmp_path)
    wait_until(sb.ready, 120, "the standby to finish its imports")
    assert sb.proc.stdin is not None
    sb.proc.stdin.close()  # the agent went away without promoting it
    assert sb.proc.wait(60) == 0


def test_a_standby_that_died_while_it_waited_is_not_promoted(tmp_path: Path, wait_until: Any) -> None:
    # the agent's promotion writes the order to a pipe nobody reads any more: an OSError, which
    # the agent takes as "not used" and starts the rank in the next standby or a new process
    sb = Standby({**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}, tmp_path)
    try:
        wait_until(sb.ready, 120, "the standby to finish its imports")
        os.killpg(sb.proc.pid, signal.SIGKILL)  # (the OOM killer, an operator)
        sb.proc.wait(30)
        with pytest.raises(OSError):
            sb.promote(0, dict(os.environ), Target(False, "train.py", ()), None, None)
    finally:
        sb.close()
    assert not sb.alive() and not list(tmp_path.glob("standby-*.ready"))


def _parking_script(tmp_path: Path, top: str) -> tuple[Path, Path]:
    """A script whose top level appends to ``top.log`` (and runs ``top``), then waits where
    ``resilient.wrap`` would, then records what it sees as a rank."""
    script = tmp_path / "job" / "train.py"
    script.parent.mkdir()
    out = tmp_path / "seen.json"
    script.write_text(
        "import json, os, sys\n"
        f"open({str(tmp_path / 'top.log')!r}, 'a').write(f'{{os.getpid()}}\\n')\n"
        f"{top}\n"
        "print('top level ran')\n"
        "from resilient.runtime.standby import park_until_promoted\n"
        "park_until_promoted()\n"
        "print('promoted')\n"
        "seen = {'name': __name__, 'argv': sys.argv, 'rank': os.environ['RANK'], 'stdin': sys.stdin.read()}\n"
        f"json.dump(seen, open({str(out)!r}, 'w'))\n"
    )
    return script, out


def test_a_parked_standby_has_run_the_top_level_and_becomes_the_rank(tmp_path: Path, wait_until: Any) -> None:
    script, out = _parking_script(tmp_path, "import argparse")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "RANK": "0"}
    tgt = Target(False, str(script), ("--steps", "4"))
    sb = Standby(env, tmp_path, park=tgt, hide=("RANK",))
    try:
        wait_until(sb.ready, 120, "the standby to park in the script")
        assert sb.warmth() == "parked" and sb.fallback() is None
        assert (tmp_path / "top.log").read_text().split() == [str(sb.proc.pid)]  # before any order
        assert sb.takes(tgt) and not sb.takes(Target(False, str(script), ("--steps", "5")))
        rank_out = tmp_path / "rank1.out"
        sb.promote(1, {**env, "RANK": "3"}, tgt, str(rank_out), None)
        assert sb.proc.wait(60) == 0
    finally:
        sb.close()
        sb.proc.wait(10)
    seen = json.loads(out.read_text())
    assert seen == {"name": "__main__", "argv": [str(script), "--steps", "4"], "rank": "3", "stdin": ""}
    assert (tmp_path / "top.log").read_text().split() == [str(sb.proc.pid)]  # the top level ran once
    assert rank_out.read_text() == "promoted\n"  # the rank's output goes where the rank's goes
    assert "top level ran" in (tmp_path / f"standby-{sb.proc.pid}.log").read_text()


@pytest.mark.parametrize(
    ("top", "why"),
    [
        ("rank = int(os.environ.get('RANK', 0))", r"the script's top level read RANK read at .*train\.py:3"),
        ("raise RuntimeError('no GPU here')", "the script's top level raised RuntimeError: no GPU here"),
        ("sys.exit(0)", "raised SystemExit"),
    ],
)
def test_a_top_level_that_needs_a_rank_falls_back_to_importing(
    tmp_path: Path, wait_until: Any, top: str, why: str
) -> None:
    import re

    script, out = _parking_script(tmp_path, top if "exit" not in top else "pass")
    if "exit" in top:  # (the script ends before it reaches wrap)
        script.write_text(script.read_text().replace("park_until_promoted()\n", "sys.exit(0)\n"))
        why = "ended without calling resilient.wrap|raised SystemExit"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "RANK": "0"}
    tgt = Target(False, str(script), ())
    sb = Standby(env, tmp_path, park=tgt, hide=("RANK",))
    try:
        reason = wait_until(sb.fallback, 120, "the standby to give up parking")
        assert re.search(why, reason), reason
        wait_until(sb.ready, 120, "the standby to wait as an importing one")
        assert sb.warmth() == "imported" and sb.takes(Target(False, "other.py", ()))
        if "exit" in top or "raise" in top:
            return  # (the promoted script would fail again, as under torchrun)
        sb.promote(1, {**env, "RANK": "3"}, tgt, None, None)
        assert sb.proc.wait(60) == 0
    finally:
        sb.close()
        sb.proc.wait(10)
    assert json.loads(out.read_text())["rank"] == "3"
    pids = (tmp_path / "top.log").read_text().split()
    assert pids == [str(sb.proc.pid)] * 2  # the same process ran the top level again, afresh


def test_an_entry_point_that_execs_ends_the_standby_and_says_why(tmp_path: Path, wait_until: Any) -> None:
    # a wrapper entry point (like `python -m chaos.netns script.py`, which re-runs the script under
    # nsenter) replaces the standby's process: the new image has lost the order pipe and must not
    # run as any rank; it says why and exits
    script, _out = _parking_script(tmp_path, "pass")
    wrapper = tmp_path / "wrapper.py"
    wrapper.write_text(f"import os, sys\nos.execv(sys.executable, [sys.executable, {str(script)!r}])\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    sb = Standby(env, tmp_path, park=Target(False, str(wrapper), ()), hide=("RANK",))
    try:
        reason = wait_until(sb.fallback, 120, "the standby to give up")
        assert "replaced its process (exec)" in reason
        assert sb.proc.wait(60) == 0
        assert not sb.ready()
    finally:
        sb.close()
        sb.proc.wait(10)


def test_a_parked_standby_freezes_the_collector_before_it_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first full collection of a process scans every object its imports made (~0.2 s with
    torch): a parked standby pays it while it waits, not once it is promoted."""
    import gc

    import resilient
    from resilient.runtime import wrapper

    class Stop(Exception):
        pass

    frozen: list[int] = []

    def park() -> None:
        frozen.append(gc.get_freeze_count())
        raise Stop

    monkeypatch.setattr(wrapper, "parking", lambda: True)
    monkeypatch.setattr(wrapper, "park_until_promoted", park)
    gc.unfreeze()
    try:
        with pytest.raises(Stop):
            resilient.wrap(lambda: None)()
    finally:
        gc.unfreeze()
    assert frozen and frozen[0] > 1000, frozen
