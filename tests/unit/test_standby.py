"""Warm standbys: what a dead worker's command becomes in a standby, and a real promotion."""

from __future__ import annotations

import json
import os
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
