"""Real faults on real gloo ranks; the run must finish with the fault-free run's state, bit for bit."""

from __future__ import annotations

import re
import signal
import sys
from pathlib import Path

import pytest
import torch

from chaos.harness import run_ranks
from resilient.errors import ExitCode
from tests.integration.conftest import ROOT, assert_bit_exact, load_states, run_example

pytestmark = pytest.mark.integration


def _check_recovered(res, reference, nproc: int, tmp: Path) -> None:
    assert res.ok, res.describe()
    states = load_states(tmp, nproc)
    for rank in range(nproc):
        n = assert_bit_exact(reference[nproc][rank]["model"], states[rank]["model"], f"rank{rank}/model")
        n += assert_bit_exact(
            reference[nproc][rank]["optimizer"], states[rank]["optimizer"], f"rank{rank}/opt"
        )
        assert n > 50  # parameters and Adam moments were really compared
    # no rank process died: every event of a rank came from one pid
    for rank in range(nproc):
        assert len({e["pid"] for e in res.events if e["rank"] == rank}) == 1
    assert len(res.of("step_resumed")) == nproc


def test_exception_on_rank1(tmp_path, reference):
    res = run_example(tmp_path, 2, "--fault", "exception@9:1")
    _check_recovered(res, reference, 2, tmp_path)
    (primary,) = {(e["origin_rank"], e["kind"], e["origin_step"]) for e in res.of("fault_detected")}
    assert primary == (1, "exception", 9)
    assert load_states(tmp_path, 2)[1]["fired"] == {"exception@9:1": 1}
    # how the group was aborted and rebuilt is in the record (docs/recovery.md#phases)
    assert {(e["abort"], e["rebuild"]) for e in res.of("group_rebuilt")} == {
        ("sockets", "init_process_group")
    }


def test_a_peer_still_in_its_steps_tail_finishes_it_and_every_rank_resumes_live(tmp_path, reference):
    # steps padded after the optimizer's step: as rank 1 raises at step 9's start, rank 0 is often
    # still in step 8's tail; it finishes that step (its successor's state captured) and leaves,
    # so both vouch for step 9 and nothing is re-run
    # (or already in step 9, blocked in its all-reduce: live either way; the tail's own rule is
    # unit-tested in tests/unit/test_live.py)
    res = run_example(tmp_path, 2, "--fault", "exception@9:1", "--step-ms", "40")
    _check_recovered(res, reference, 2, tmp_path)
    restored = res.of("state_restored")
    assert {(e["step"], e["source"], e["steps_rerun"]) for e in restored} == {(9, "live", 0)}, restored
    assert {e["rank"]: e["step"] for e in res.of("fault_detected")}[0] in (8, 9)


def test_ddp_at_3_ranks_recovers_bit_exact(tmp_path, reference):
    # with 3 ranks the ring adds the ranks' gradients in an order that depends on where each sits in
    # DDP's bucket: the rebuilt DDP must start with the buckets the interrupted one had rebuilt
    res = run_example(tmp_path, 3, "--fault", "exception@9:2")
    _check_recovered(res, reference, 3, tmp_path)


def test_sleep_hang_on_rank0_is_interrupted_in_process(tmp_path, reference):
    res = run_example(tmp_path, 2, "--fault", "hang@7:0", "--hang-timeout", "2")
    _check_recovered(res, reference, 2, tmp_path)
    kinds = {e["kind"] for e in res.of("fault_detected")}
    assert kinds == {"hang"}, kinds
    # the hanging rank left time.sleep(3600) in-process: it resumed, and well before the sleep ends
    resumed = [e for e in res.of("step_resumed") if e["rank"] == 0]
    assert resumed and resumed[0]["since_fault_s"] < 10


def test_collective_timeout_when_a_rank_stalls(tmp_path, reference):
    """Rank 1 stalls 30 s before a collective; rank 0's collective times out (1.5 s). No socket can
    reach the sleeping rank 1: only the store notification can, and it must leave the sleep at once
    rather than at hang_timeout (20 s) or the end of its stall."""
    res = run_example(
        tmp_path, 2, "--fault", "stall@10:1=30", "--hang-timeout", "20", "--collective-timeout", "1.5"
    )
    _check_recovered(res, reference, 2, tmp_path)
    primaries = {(e["origin_rank"], e["kind"]) for e in res.of("fault_detected")}
    assert primaries == {(0, "collective")}, primaries  # rank 0's collective timed out
    assert all("Timed out" in e["signature"] for e in res.of("fault_detected"))
    local = {e["rank"]: e["local"] for e in res.of("fault_detected")}
    assert local[1].startswith("StepInterrupted: peer: rank 0 faulted at step 10"), local
    assert max(e["since_fault_s"] for e in res.of("step_resumed")) < 3.0, res.of("step_resumed")


def test_oom_exception_recovers(tmp_path, reference):
    res = run_example(tmp_path, 2, "--fault", "oom@5:0")
    _check_recovered(res, reference, 2, tmp_path)
    assert {e["kind"] for e in res.of("fault_detected")} == {"oom"}


def test_repeating_fault_stops_with_diagnosis(tmp_path):
    res = run_example(tmp_path, 2, "--fault", "exception@6:1x10", "--max-repeats", "3")
    assert not res.timed_out, res.describe()
    for r in res.ranks:
        assert r.returncode == ExitCode.FATAL, res.describe()
        assert "FaultRepeats: fault repeats at step 6: exception: InjectedFault" in r.stderr
    assert len(res.of("fault_detected")) == 3 * 2  # three faults seen by both ranks, then stop
    assert len(res.of("run_failed")) == 2


def test_bad_config_names_field_value_and_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("hang_timeout: -5\nrestart:\n  max_recoveries: 2\n")
    res = run_example(tmp_path, 2, "--config", str(bad))
    for r in res.ranks:
        assert r.returncode != 0
        assert f"{bad}: hang_timeout = -5: Input should be greater than 0" in r.stderr
    assert not res.events  # failed at decoration time: nothing started


def test_a_fault_that_leaves_autograd_off_re_enters_with_it_on(tmp_path):
    # found on torch 2.9: a peer's interrupt landing inside a no-grad region left the rank without
    # autograd, and every re-entry failed ("does not require grad") until the run gave up
    solo = {"MASTER_ADDR": "", "MASTER_PORT": "", "RANK": "0", "WORLD_SIZE": "1"}
    script = str(Path(__file__).with_name("_grad_off_fault.py"))
    res = run_ranks([script], 1, cwd=tmp_path, run_id="grad", env=solo)
    assert res.ok, res.describe()
    assert [e["local"].split(":")[0] for e in res.of("fault_detected")] == ["RuntimeError"]


def test_single_process_without_launcher(tmp_path):
    """No torchrun, no env: the runtime hosts its own store; an exception is still recovered."""
    solo = {"MASTER_ADDR": "", "MASTER_PORT": "", "RANK": "0", "WORLD_SIZE": "1"}
    argv = [str(ROOT / "examples/train_tiny.py"), "--steps", "12"]
    ref = run_ranks([*argv, "--out", "ref"], 1, cwd=tmp_path, run_id="ref", env=solo)
    hit = run_ranks(
        [*argv, "--out", "hit", "--fault", "exception@5:0"], 1, cwd=tmp_path, run_id="hit", env=solo
    )
    assert ref.ok and hit.ok, ref.describe() + hit.describe()
    a = torch.load(tmp_path / "ref" / "rank0.pt", weights_only=True)
    b = torch.load(tmp_path / "hit" / "rank0.pt", weights_only=True)
    assert assert_bit_exact(a["model"], b["model"]) + assert_bit_exact(a["optimizer"], b["optimizer"]) > 50
    assert [e["origin_step"] for e in hit.of("fault_detected")] == [5]


def test_failed_health_check_exits_hard_fault_naming_the_check(tmp_path):
    cfg = tmp_path / "unhealthy.yaml"
    cfg.write_text("health:\n  min_host_memory_mb: 100000000\n")
    res = run_example(tmp_path, 2, "--fault", "exception@4:1", "--config", str(cfg))
    assert not res.timed_out, res.describe()
    for r in res.ranks:
        assert r.returncode == ExitCode.HARD_FAULT, res.describe()
        assert "health check 'host_memory' failed" in r.stderr
    assert all(not e["ok"] for e in res.of("health_checked"))


@pytest.mark.slow  # (CI's budget: the GIL hang stays in CI through test_replace)
@pytest.mark.skipif(sys.platform != "linux", reason="SIGALRM/faulthandler backstop is Linux-tested")
def test_gil_holding_hang_ends_by_sigalrm_with_stacks(tmp_path):
    res = run_example(tmp_path, 2, "--fault", "gil_hang@5:1", "--hang-timeout", "1", timeout=60)
    assert not res.timed_out, res.describe()
    r1 = res.ranks[1]
    assert r1.returncode == -signal.SIGALRM, res.describe()
    assert "most recent call first" in r1.stderr  # faulthandler dumped the stacks
    assert "chaos/inject.py" in r1.stderr


def test_under_torchrun_with_agent_store(tmp_path, reference):
    """torchrun's env:// with TORCHELASTIC_USE_AGENT_STORE: the runtime joins the agent's store."""
    import os
    import subprocess

    env = {**os.environ, "OMP_NUM_THREADS": "1", "RESILIENT_RUN_ID": "torchrun"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(ROOT / "examples/train_tiny.py"),
        "--steps",
        "24",
        "--out",
        str(tmp_path / "state"),
        "--fault",
        "exception@9:1",
    ]
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, start_new_session=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    states = load_states(tmp_path, 2)
    for rank in range(2):
        assert assert_bit_exact(reference[2][rank]["model"], states[rank]["model"]) > 20
        assert assert_bit_exact(reference[2][rank]["optimizer"], states[rank]["optimizer"]) > 20
    from resilient.events import read_events

    events = read_events(tmp_path / "resilient_runs" / "torchrun" / "events.jsonl")
    assert [e["origin_rank"] for e in events if e["event"] == "fault_detected"] == [1, 1]


def _desync_run(tmp: Path, check: str, plan: str):
    tmp.mkdir(parents=True, exist_ok=True)
    env = {"CHAOS_FINAL_STATE": str(tmp / "state")} | ({"CHAOS_PLAN": plan} if plan else {})
    script = str(Path(__file__).with_name("_desync_train.py"))
    return run_ranks([script, "--check", check], 2, cwd=tmp, run_id=f"desync-{check}-{bool(plan)}", env=env,
                     timeout=90)  # fmt: skip


def test_skipped_collective_is_a_desync_fault_never_a_silent_wrong_state(tmp_path):
    """Rank 1 skips one of three equal-shape all-reduces at step 8 (a real skip: the call is not
    issued). Every later all-reduce then pairs with the wrong one and gives wrong sums without an
    error. With the collective check the step is refused and restored: bit-exact. Without it the run
    also "recovers" (from the hang at the very end) but from snapshots taken after the corruption."""
    ref = _desync_run(tmp_path / "ref", "on", "")
    assert ref.ok, ref.describe()
    expected = [torch.load(tmp_path / "ref" / "state" / f"rank{r}.pt", weights_only=True) for r in range(2)]

    res = _desync_run(tmp_path / "on", "on", "desync@8:1")
    assert res.ok, res.describe()
    faults = res.of("fault_detected")
    assert faults and {e["kind"] for e in faults} == {"desync"}, faults
    # counts are compared where state is kept: the fault names the window that holds step 8
    windows = [re.search(r"desync in steps (\d+)-(\d+)", e["local"]) for e in faults]
    assert any(w and int(w[1]) <= 8 <= int(w[2]) for w in windows), faults
    got = [torch.load(tmp_path / "on" / "state" / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for r in range(2):
        assert_bit_exact(expected[r], got[r], f"rank{r}")

    off = _desync_run(tmp_path / "off", "off", "desync@8:1")
    assert off.ok, off.describe()  # it "finished" ...
    bad = [torch.load(tmp_path / "off" / "state" / f"rank{r}.pt", weights_only=True) for r in range(2)]
    with pytest.raises(AssertionError):  # ... with a model the fault-free run never had
        assert_bit_exact(expected[0]["model"], bad[0]["model"], "rank0/model")


@pytest.mark.parametrize(
    ("how", "who", "shown"),
    [
        ("import", 1, "ModuleNotFoundError: No module named 'not_a_module_of_this_project'"),
        ("track", -1, "TypeError: cannot track data=list: it needs state_dict()/load_state_dict()"),
        ("steps", 0, "ValueError: total steps must be >= 0, got -1"),
    ],
)
def test_an_error_before_the_first_step_is_shown_as_itself(tmp_path, how, who, shown):
    """Nothing to restore yet: not retried, the user's own exception and traceback, exit FATAL on
    every rank; the ranks that did not raise it name the one that did."""
    res = run_ranks([str(Path(__file__).with_name("_setup_error.py")), how, str(who)], 2, cwd=tmp_path)
    assert not res.timed_out, res.describe()
    culprits = [0, 1] if who == -1 else [who]
    own = []
    for rank, r in enumerate(res.ranks):
        assert r.returncode == ExitCode.FATAL, res.describe()
        assert "no snapshot step held" not in r.stderr, r.stderr
        if f"rank {rank} raised this before its first step" in r.stderr:  # its own, as raised
            tail = r.stderr[r.stderr.rindex("Traceback (most recent call last)") :]
            assert "_setup_error.py" in tail and shown in tail, r.stderr
            own.append(rank)
        else:  # pulled out by the culprit first (with -1: perhaps before its own error): named
            named = re.search(r"SetupFailed: rank (\d) failed before the first step: (\w+)", r.stderr)
            assert named and int(named[1]) in culprits and named[2] == shown.split(":")[0], r.stderr
    assert own and set(own) <= set(culprits), res.describe()
    assert not res.of("state_restored") and not res.of("step_resumed")


def test_a_rank_a_step_behind_the_one_that_faulted_finishes_its_step_and_both_resume_live(
    tmp_path: Path,
) -> None:
    # rank 1 raises at the start of step 12 while rank 0 is in step 11's tail (after its
    # backward, before its update): rank 0 finishes step 11 and leaves at its end, so both vouch
    # for step 12 and resume there live, not from the ring's snapshot of step 10
    script = str(Path(__file__).with_name("_behind_train.py"))
    (tmp_path / "ref").mkdir()
    (tmp_path / "hit").mkdir()
    ref = run_ranks([script], 2, cwd=tmp_path / "ref", run_id="ref", timeout=120)
    assert ref.ok, ref.describe()
    hit = run_ranks([script, "fault"], 2, cwd=tmp_path / "hit", run_id="hit", timeout=120)
    assert hit.ok, hit.describe()
    agreed = {e["rank"]: e for e in hit.of("restore_agreed")}
    assert {r: (e["step"], e["source"]) for r, e in agreed.items()} == {0: (12, "live"), 1: (12, "live")}, (
        agreed
    )
    assert agreed[0]["fault_step"] == 11  # (rank 0 was a step behind when the fault came)
    want = torch.load(tmp_path / "ref" / "final.pt")
    got = torch.load(tmp_path / "hit" / "final.pt")
    assert assert_bit_exact(want, got, "model") >= 4
