"""``engine: nvrx``: the same decorated example under NVRx's in-process Wrapper, real faults.

NVRx detects and restarts; our snapshot ring restores the state. The final state must equal the
fault-free run's (made by the built-in engine: the engines must not change what is computed)."""

from __future__ import annotations

import pytest

from resilient.errors import ExitCode
from tests.integration.conftest import assert_bit_exact, load_states, run_example

pytest.importorskip("nvidia_resiliency_ext.inprocess")
pytestmark = pytest.mark.integration


def _check_same_processes_bit_exact(res, reference, tmp_path) -> None:
    assert res.ok, res.describe()
    states = load_states(tmp_path, 2)
    for rank in range(2):
        n = assert_bit_exact(reference[2][rank]["model"], states[rank]["model"], f"rank{rank}/model")
        n += assert_bit_exact(reference[2][rank]["optimizer"], states[rank]["optimizer"], f"rank{rank}/opt")
        assert n > 50
        assert len({e["pid"] for e in res.events if e["rank"] == rank}) == 1  # recovered in-process
    assert {e["engine"] for e in res.of("run_started")} == {"nvrx"}
    assert len(res.of("run_finished")) == 2  # in the event log, not only in the process's log
    assert len(res.of("step_resumed")) == 2


def test_exception_recovers_bit_exact_under_nvrx(tmp_path, reference):
    res = run_example(tmp_path, 2, "--engine", "nvrx", "--fault", "exception@9:1", "--hang-timeout", "3")
    _check_same_processes_bit_exact(res, reference, tmp_path)
    (primary,) = {(e["origin_rank"], e["kind"], e["origin_step"]) for e in res.of("fault_detected")}
    assert primary == (1, "exception", 9)


def test_sleep_hang_is_interrupted_in_process_under_nvrx(tmp_path, reference):
    """NVRx's asynchronous exception alone never reaches a main thread in time.sleep(3600); the
    engine's abort signals it so the exception is delivered."""
    res = run_example(tmp_path, 2, "--engine", "nvrx", "--fault", "hang@7:0", "--hang-timeout", "2")
    _check_same_processes_bit_exact(res, reference, tmp_path)
    assert {e["kind"] for e in res.of("fault_detected")} == {"hang"}
    assert all(e["since_fault_s"] < 10 for e in res.of("step_resumed"))


def test_repeating_fault_stops_with_diagnosis_under_nvrx(tmp_path):
    res = run_example(
        tmp_path,
        2,
        "--engine",
        "nvrx",
        "--fault",
        "exception@6:1x10",
        "--max-repeats",
        "3",
        "--hang-timeout",
        "3",
    )
    assert not res.timed_out, res.describe()
    for r in res.ranks:
        assert r.returncode == ExitCode.FATAL, res.describe()
        assert "fault repeats at step 6: exception: InjectedFault" in r.stderr
    assert len(res.of("run_failed")) == 2


@pytest.mark.parametrize(
    "timeouts",
    # (CI's budget: one of the two orders)
    [
        pytest.param(("--hang-timeout", "2"), marks=pytest.mark.slow),
        ("--hang-timeout", "3", "--collective-timeout", "1"),
    ],
    ids=["nvrx-soft-timeout-first", "gloo-timeout-first"],
)
def test_skipped_gradient_sync_is_a_desync_never_a_silent_wrong_state_under_nvrx(
    tmp_path, reference, timeouts
):
    """Rank 1 does not all-reduce step 9's gradients (a real skip). Its peer's all-reduce then
    waits for one rank 1 never issues, until NVRx's soft timeout interrupts both or the gloo
    timeout ends it (whichever comes first); either way the collective counts name the fault, and
    the state restored is from before the skip: bit-exact."""
    res = run_example(tmp_path, 2, "--engine", "nvrx", "--fault", "desync@9:1", *timeouts)
    _check_same_processes_bit_exact(res, reference, tmp_path)
    kinds = {e["kind"] for e in res.of("fault_detected")}
    assert kinds == {"desync"}, res.of("fault_detected")


def test_an_error_before_the_first_step_is_fatal_and_named_under_nvrx(tmp_path):
    from pathlib import Path

    from chaos.harness import run_ranks

    script = str(Path(__file__).with_name("_setup_error.py"))
    res = run_ranks([script, "import", "1", "nvrx"], 2, cwd=tmp_path, timeout=90)
    assert not res.timed_out, res.describe()
    for r in res.ranks:  # not restarted: exit FATAL on both, the culprit and its exception named
        assert r.returncode == ExitCode.FATAL, res.describe()
        assert (
            "SetupFailed: rank 1 failed before the first step: ModuleNotFoundError: "
            "No module named 'not_a_module_of_this_project'" in r.stderr
        ), r.stderr
