"""`resilient launch --replace rank`: a dead worker is replaced alone, its survivors stay in their
processes, and the run ends bit for bit where the fault-free run ends."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import EXAMPLE, STEPS, assert_bit_exact
from tests.integration.test_launcher import (
    Launch,
    _example,
    _final_states,
    _signal_after_checkpoint,
    _worker_pid,
)

pytestmark = pytest.mark.integration


def _pids(events: list[dict[str, Any]], rank: int) -> list[int]:
    seen: list[int] = []
    for e in events:
        if e["event"] == "run_started" and e["rank"] == rank and e["pid"] not in seen:
            seen.append(e["pid"])
    return seen


def _bit_exact(ref: list[dict[str, Any]], got: list[dict[str, Any]]) -> None:
    """The training state equals the fault-free run's (what the injector fired is not state: a
    survivor still holds the plan its first process was given, the replacement none)."""
    for r, (a, b) in enumerate(zip(ref, got, strict=True)):
        a, b = dict(a), dict(b)
        for k in ("fired", "built_at"):  # (what fired, and when the model was built, are not state)
            a.pop(k, None), b.pop(k, None)
        assert_bit_exact(a, b, f"rank{r}")


@pytest.mark.parametrize(
    ("fault", "standby"),
    # (a new process instead of a standby, and SIGSTOP, whose heartbeat path gil_hang's test takes
    # in CI: the slow session, to keep CI within its budget)
    [
        # (CI keeps the replacement that resumes from a survivor's live state, below)
        pytest.param("SIGKILL", 1, marks=pytest.mark.slow),
        pytest.param("SIGSTOP", 1, marks=pytest.mark.slow),
        pytest.param("SIGKILL", 0, marks=pytest.mark.slow),
    ],
)
def test_a_dead_rank_is_replaced_and_its_survivor_stays_bit_exact(
    tmp_path: Path, fault: str, standby: int, reference: dict[int, list[dict[str, Any]]]
) -> None:
    # with a standby it is promoted; without one, a new process is started (slower steps here:
    # the standby starts once the workers step, and must have finished its imports)
    run = _example(tmp_path, "--step-ms", "250", replace="rank", launch=("--standby", str(standby)))
    victim = _signal_after_checkpoint(run, 1, fault, standby=bool(standby))
    events = run.events()
    replaced = [e for e in events if e["event"] == "rank_replaced"]
    assert len(replaced) == 1 and replaced[0]["old_pid"] == victim, replaced
    assert replaced[0]["fault_posted"] and replaced[0]["standby"] == bool(standby), replaced
    if standby:  # it had run the example's imports and top level, and waited in resilient.wrap
        ready = [e for e in events if e["event"] == "standby_ready"]
        assert ready and ready[0]["warmth"] == "parked", ready
        assert not [e for e in events if e["event"] == "standby_fallback"]
    assert not [e for e in events if e["event"] == "relaunched"], "the whole group was restarted"
    assert len(_pids(events, 0)) == 1, "the survivor's process changed"
    assert _pids(events, 1) == [victim, replaced[0]["new_pid"]]
    # the survivor recovered in-process; the replacement restored from the dead rank's shm snapshot
    restored = [e for e in events if e["event"] == "state_restored"]
    assert {e["rank"] for e in restored} == {0, 1} and len({e["step"] for e in restored}) == 1, restored
    _bit_exact(reference[2], _final_states(tmp_path))


@pytest.mark.parametrize("nproc", [2, pytest.param(3, marks=pytest.mark.slow)])  # (3 ranks: CI's budget)
def test_a_replacement_resumes_the_step_its_predecessor_died_in_from_a_survivors_live_state(
    tmp_path: Path, nproc: int, reference: dict[int, list[dict[str, Any]]]
) -> None:
    # killed in a step's forward (where the padding sleeps): the survivors wait in the backward's
    # all-reduce, their models and optimizers as the step found them; the replacement takes rank
    # 0's, and its predecessor's own step-start capture from shared memory (runtime/steps/handover.py)
    # The launch is the README's, every launcher flag at its default (a dead rank is replaced alone
    # though torchrun's --max-restarts would be 0: the replacements have their own budget)
    victim = nproc - 1
    run = Launch(
        tmp_path, "--standalone", "--nproc-per-node", str(nproc),
        EXAMPLE, "--steps", str(STEPS), "--step-ms", "250", "--pad-at", "forward",
        "--ckpt-dir", str(tmp_path / "ck"), "--ckpt-every", "4", "--out", str(tmp_path / "state"),
    )  # fmt: skip
    _signal_after_checkpoint(run, victim, standby=True, fresh_step=True)
    replaced = _replaced_alone(run, victim, nproc)
    events = run.events()
    started = next(e for e in events if e["event"] == "workers_started")
    budgets = ("max_restarts", "max_replacements", "replacements_left")
    assert [started[k] for k in budgets] == [3, 10, 10], started
    assert replaced["replacements_left"] == 9 and replaced["restarts_left"] == 3, replaced
    agreed = {e["rank"]: e for e in events if e["event"] == "restore_agreed"}
    sources = {r: "peer" if r == victim else "live" for r in range(nproc)}
    assert {r: e["source"] for r, e in agreed.items()} == sources, agreed
    assert len({e["step"] for e in agreed.values()}) == 1 and agreed[0]["step"] == agreed[0]["fault_step"]
    restored = {e["rank"]: e for e in events if e["event"] == "state_restored"}
    assert {r: e["source"] for r, e in restored.items()} == sources, restored
    assert all(e["steps_rerun"] == 0 for e in restored.values()), restored  # nothing re-run
    _bit_exact(reference[nproc], _final_states(tmp_path, nproc))


def _replaced_alone(run: Launch, victim_rank: int, nproc: int = 2) -> dict[str, Any]:
    """The run's one replacement: only ``victim_rank``'s process is new, the survivors' are not."""
    events = run.events()
    replaced = [e for e in events if e["event"] == "rank_replaced"]
    assert len(replaced) == 1 and replaced[0]["global_rank"] == victim_rank, replaced
    assert not [e for e in events if e["event"] == "relaunched"], "the whole group was restarted"
    for r in range(nproc):
        assert len(_pids(events, r)) == (2 if r == victim_rank else 1), (r, _pids(events, r))
    return replaced[0]


def test_gil_holding_hang_is_replaced_alone(
    tmp_path: Path, reference: dict[int, list[dict[str, Any]]]
) -> None:
    # rank 1 enters a C-level regex backtrack that never releases the GIL: its heartbeat stops, the
    # agent kills and replaces it. The fault is the launcher's (--fault): it fires once per job, so
    # the replacement, which resumes at step 10, does not hang again
    run = _example(tmp_path, replace="rank", launch=("--fault", "gil_hang@10:1"))
    assert run.finish() == 0, run.output()
    replaced = _replaced_alone(run, 1)
    assert "no heartbeat" in replaced["cause"], replaced
    _bit_exact(reference[2], _final_states(tmp_path))


def test_kernel_oom_kill_is_replaced_alone(
    tmp_path: Path, memory_cgroup: Path, reference: dict[int, list[dict[str, Any]]]
) -> None:
    # rank 1's first process runs in a 700 MiB cgroup and touches memory until the kernel kills it
    run = _example(tmp_path, "--fault", "kernel_oom@10:1", "--fault-attempt", "0", replace="rank")
    try:
        victim = _worker_pid(run, 1)
        (memory_cgroup / "cgroup.procs").write_text(str(victim))
        rc = run.finish()
    finally:
        if run.p.poll() is None:
            run.finish(timeout=1)
    assert rc == 0, run.output()
    replaced = _replaced_alone(run, 1)
    assert replaced["cause"] == "killed by SIGKILL (OOM-killed by the kernel)", replaced
    _bit_exact(reference[2], _final_states(tmp_path))


@pytest.mark.slow  # (CI's budget: a replacement's live resume at 3 ranks stays in CI)
def test_a_replacement_at_3_ranks_keeps_ddp_buckets_bit_exact(
    tmp_path: Path, reference: dict[int, list[dict[str, Any]]]
) -> None:
    # with 3 ranks gloo's ring sums depend on DDP's bucket layout: the replacement's new DDP and
    # the survivors' rebuilt ones must all start from the layout the dead generation had
    run = _example(tmp_path, nproc=3, replace="rank")
    _signal_after_checkpoint(run, 2)
    _replaced_alone(run, 2, nproc=3)
    _bit_exact(reference[3], _final_states(tmp_path, 3))


def test_a_replacement_killed_in_its_restore_falls_back_to_the_group(
    tmp_path: Path, reference: dict[int, list[dict[str, Any]]]
) -> None:
    # a double fault: the replacement dies before its first step; the agent restarts the group
    # (the reason in its log) and the run still ends bit-exact
    run = _example(tmp_path, replace="rank")
    try:
        run.wait_event("checkpoint_saved", lambda e: e["step"] >= 8 and e["rank"] == 1)
        os.kill(_worker_pid(run, 1), signal.SIGKILL)
        replaced = run.wait_event("rank_replaced")
        os.kill(replaced["new_pid"], signal.SIGKILL)  # while it starts, restores or joins
        rc = run.finish()
    finally:
        if run.p.poll() is None:
            run.finish(timeout=1)
    assert rc == 0, run.output()
    events = run.events()
    assert [e["event"] for e in events].count("relaunched") == 1, run.output()
    stopped = [e for e in events if e["event"] == "group_stopped"]
    assert "rank 1 not replaced alone: it died before its first step" in stopped[0]["reason"], stopped
    _bit_exact(reference[2], _final_states(tmp_path))


# (slow session, to keep CI within its budget: tests/unit/test_standby.py names the read in CI)
@pytest.mark.slow
def test_a_top_level_that_reads_the_rank_gets_an_importing_standby_that_says_why(
    tmp_path: Path, reference: dict[int, list[dict[str, Any]]]
) -> None:
    # the user's script reads RANK before resilient.wrap: no standby can park in it (it would take
    # another rank's place with this rank's value); the standby imports only, says why, and the
    # replacement still ends bit-exact
    script = tmp_path / "train_rank_at_top.py"
    script.write_text(
        "import os, runpy, sys\n"
        "print('rank', os.environ.get('RANK'))  # rank-dependent work at the top level\n"
        f"sys.argv[0] = {EXAMPLE!r}\n"
        f"runpy.run_path({EXAMPLE!r}, run_name='__main__')\n"
    )
    cwd = tmp_path / "run"
    run = Launch(
        cwd,
        "--standalone", "--nproc-per-node", "2", "--max-restarts", "3", "--monitor-interval", "0.2",
        "--replace", "rank", "--standby", "1",
        "--heartbeat-timeout", "3", "--startup-timeout", "60", "--backoff-initial", "0",
        # (slow steps: the standby tries to park, execs itself and imports again before it waits)
        str(script), "--steps", str(STEPS), "--step-ms", "1000", "--ckpt-dir", str(cwd / "ck"),
        "--ckpt-every", "4", "--out", str(cwd / "state"),
    )  # fmt: skip
    _signal_after_checkpoint(run, 1, "SIGKILL", standby=True)
    events = run.events()
    (fallback,) = [e for e in events if e["event"] == "standby_fallback"]
    assert f"RANK read at {script}:2" in fallback["reason"], fallback
    ready = [e for e in events if e["event"] == "standby_ready"]
    assert ready[0]["warmth"] == "imported" and ready[0]["standby_pid"] == fallback["standby_pid"], ready
    assert [e["standby"] for e in events if e["event"] == "rank_replaced"] == [True]
    _bit_exact(reference[2], _final_states(cwd))


@pytest.mark.slow  # (CI: tests/integration/test_hf_trainer.py's SIGKILL of a transformers script, parked)
def test_a_parked_standby_replaces_a_rank_of_a_transformers_script_bit_exact(tmp_path: Path) -> None:
    # examples/train_hf.py: a GPT-2 from a config, DDP, DataLoader epochs, dropout; its top level
    # imports transformers (seconds), which the parked standby has done before the kill
    pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    script = str(Path(EXAMPLE).parent / "train_hf.py")

    def launch(cwd: Path) -> Launch:
        return Launch(
            cwd,
            "--standalone", "--nproc-per-node", "2", "--max-restarts", "3", "--monitor-interval", "0.2",
            "--replace", "rank", "--standby", "1",
            "--heartbeat-timeout", "3", "--startup-timeout", "60", "--backoff-initial", "0",
            script, "--steps", "60", "--epochs", "2", "--step-ms", "200", "--ckpt-dir", str(cwd / "ck"),
            "--ckpt-every", "4", "--out", str(cwd / "state"),
        )  # fmt: skip

    ref = launch(tmp_path / "ref")
    assert ref.finish() == 0, ref.output()
    run = launch(tmp_path / "run")
    _signal_after_checkpoint(run, 1, "SIGKILL", standby=True)
    events = run.events()
    assert next(e["warmth"] for e in events if e["event"] == "standby_ready") == "parked"
    assert [e["standby"] for e in events if e["event"] == "rank_replaced"] == [True]
    _bit_exact(_final_states(tmp_path / "ref"), _final_states(tmp_path / "run"))


@pytest.mark.slow  # (CI's budget: the parked standby's handover stays in CI)
def test_what_prepare_builds_is_built_by_the_parked_standby_before_the_fault(tmp_path: Path) -> None:
    # `resilient.wrap(prepare=build)`: the example's model is built by the parked standby before
    # the kill (its build time precedes the replacement), and the run ends as a fault-free one does
    ref = _example(tmp_path / "ref", "--prepare", replace="rank")  # (fault-free: the state to end with)
    assert ref.finish() == 0, ref.output()
    warm = ("--standby", "1")
    run = _example(tmp_path / "run", "--step-ms", "250", "--prepare", replace="rank", launch=warm)
    _signal_after_checkpoint(run, 1, "SIGKILL", standby=True)
    (replaced,) = [e for e in run.events() if e["event"] == "rank_replaced"]
    final = _final_states(tmp_path / "run")
    assert final[1]["built_at"] < replaced["ts"]  # the replacement's model was built before the kill
    _bit_exact(_final_states(tmp_path / "ref"), final)
