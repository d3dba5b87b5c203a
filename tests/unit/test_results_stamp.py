"""chaos.results: what every file under benchmarks/results/ carries (the stamp), a command without
this machine's paths, and a partial run that never replaces a complete result."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from chaos import results

STAMPED = ("commit", "tree_clean", "date", "command", "python", "torch", "cores", "load_before")


def _read(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.mark.parametrize("data", [{"a": 1, "wall_s": 9.5}, [{"a": 1}, {"a": 2}]], ids=["dict", "list"])
def test_write_adds_the_stamp_to_a_dict_and_puts_a_list_under_results(tmp_path: Path, data: object) -> None:
    st = results.begin(trials=3)
    out = tmp_path / "r.json"
    assert results.write(out, data, st) == out
    got = _read(out)
    if isinstance(data, dict):
        assert got["a"] == 1 and got["wall_s"] == 9.5  # (the data's own keys kept, its wall_s too)
        assert set(got) == {"a", "wall_s", "stamp"}
    else:
        assert set(got) == {"results", "stamp"} and got["results"] == data
    stamp = got["stamp"]
    for key in (*STAMPED, "load_after", "wall_s", "loaded", "complete"):
        assert key in stamp, key
    assert stamp["commit"] and stamp["complete"] is True and stamp["trials"] == 3
    assert stamp["cores"] >= 1 and len(stamp["load_before"]) == len(stamp["load_after"]) == 3
    assert stamp["wall_s"] >= 0 and isinstance(stamp["loaded"], bool)
    assert "_t0" not in stamp  # (the monotonic start is the begin's own, not the file's)


def test_the_command_names_no_path_outside_the_repository(monkeypatch: pytest.MonkeyPatch) -> None:
    inside = str(results.ROOT / "benchmarks" / "bench.py")
    argv = ["/some/where/bench.py", "--python", "/opt/x/bin/python3", "--script", inside, "--trials", "5"]
    monkeypatch.setattr(sys, "argv", argv)
    command = results.begin(command=None)["command"]
    assert command == "python <bench.py> --python <python> --script benchmarks/bench.py --trials 5"
    assert "/some/where" not in command and "/opt/x" not in command
    assert results.begin(command="given as is")["command"] == "given as is"


def test_a_partial_run_goes_beside_a_complete_result_and_never_replaces_it(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    results.write(out, {"n": "complete"}, results.begin())
    before = out.read_bytes()
    went = results.write(out, {"n": "partial"}, results.begin(), complete=False)
    assert went == tmp_path / "bench.partial.json"
    assert out.read_bytes() == before  # (the complete result unchanged)
    assert _read(went)["n"] == "partial" and _read(went)["stamp"]["complete"] is False


def test_a_partial_run_onto_nothing_or_onto_a_partial_result_writes_the_path_itself(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    assert results.write(out, {"cells": 1}, results.begin(), complete=False) == out  # (onto nothing)
    assert results.write(out, {"cells": 2}, results.begin(), complete=False) == out  # (onto a partial)
    got = _read(out)
    assert got["cells"] == 2 and got["stamp"]["complete"] is False
    assert not (tmp_path / "bench.partial.json").exists()
    assert results.write(out, {"cells": 3}, results.begin()) == out  # (and the complete one replaces it)
    assert _read(out)["stamp"]["complete"] is True


def test_a_complete_run_removes_the_partial_one_it_supersedes_and_no_machine_path_is_written(
    tmp_path: Path,
) -> None:
    out = tmp_path / "bench.json"
    results.write(out, {"n": 1}, results.begin())
    results.write(out, {"n": 2}, results.begin(), complete=False)
    assert (tmp_path / "bench.partial.json").exists()
    where = {"script": str(results.ROOT / "examples" / "train_tiny.py"), "python": sys.prefix + "/bin/python"}
    results.write(out, where, results.begin())
    assert not (tmp_path / "bench.partial.json").exists()
    got = _read(out)
    assert got["script"] == "./examples/train_tiny.py" and got["python"] == "<venv>/bin/python"
