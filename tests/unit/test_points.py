"""Points outside a run's recovery (a checkpoint's commit) reach the run's hooks, and a fault a
hook raises there is raised at the point: the commit fails, nothing is renamed."""

from __future__ import annotations

from pathlib import Path

import pytest

from resilient import points
from resilient.checkpoint.writer import commit


def test_a_listener_hears_points_until_removed() -> None:
    heard: list[tuple[str, int | None]] = []
    stop = points.listen(lambda p, s: heard.append((p, s)))
    points.reached("commit", 5)
    stop()
    stop()  # (twice: harmless)
    points.reached("commit", 10)
    assert heard == [("commit", 5)]


def test_a_fault_raised_at_the_commit_leaves_nothing_committed(tmp_path: Path) -> None:
    from resilient.checkpoint.manifest import committed_steps, tmp_name
    from resilient.checkpoint.writer import part_name

    class Fault(Exception):
        pass

    def strike(point: str, step: int | None) -> None:
        raise Fault(f"at {point} of step {step}")

    tmp = tmp_path / tmp_name(5, "tok")
    tmp.mkdir()
    (tmp / part_name(0)).write_text('{"rank": 0, "skeleton": null, "tensors": [], "files": []}')
    stop = points.listen(strike)
    try:
        with pytest.raises(Fault, match="at commit of step 5"):
            commit(tmp_path, 5, "tok", 1, timeout=5.0)
    finally:
        stop()
    assert committed_steps(tmp_path) == []
