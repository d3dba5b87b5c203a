"""`resilient launch` under hard faults: real SIGKILL and SIGSTOP of a worker, exit-code verdicts."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from resilient.errors import ExitCode
from tests._wait import wait_until
from tests.integration.conftest import EXAMPLE, STEPS, assert_bit_exact

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
EXIT_WITH = str(Path(__file__).with_name("_exit_with.py"))
FAIL_THEN_SUCCEED = str(Path(__file__).with_name("_fail_then_succeed.py"))


class Launch:
    """``resilient launch`` in its own session; the whole session is SIGKILLed at the end."""

    def __init__(self, cwd: Path, *argv: str) -> None:
        cwd.mkdir(parents=True, exist_ok=True)
        self.cwd = cwd
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        env.pop("RESILIENT_RUN_ID", None)
        self.tmp = cwd / "tmp"  # the launch's temporary files (torch's log dir) land in the test's dir
        self.tmp.mkdir(exist_ok=True)
        env["TMPDIR"] = str(self.tmp)
        self.log = open(cwd / "launch.log", "w+")  # noqa: SIM115 - closed in finish()
        self.p = subprocess.Popen(
            [sys.executable, "-m", "resilient.cli", "launch", *argv],
            cwd=cwd, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip

    def events(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for f in (self.cwd / "resilient_runs").glob("*/events.jsonl"):
            out += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        return sorted(out, key=lambda e: e["ts"])

    def wait_event(self, name: str, pred: Any = lambda e: True, timeout: float = 60.0) -> dict[str, Any]:
        def logged() -> dict[str, Any] | None:  # another process writes the log: poll it
            for e in self.events():
                if e["event"] == name and pred(e):
                    return e
            assert self.p.poll() is None, f"launcher exited rc={self.p.returncode}:\n{self.output()}"
            return None

        return wait_until(logged, timeout, lambda: f"a {name} event:\n{self.output()}")

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return (self.cwd / "launch.log").read_text()[-4000:]

    def finish(self, timeout: float = 120.0) -> int:
        try:
            return self.p.wait(timeout)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.p.pid, signal.SIGKILL)  # the launcher
            self.p.wait()
            # workers run in sessions of their own (torch's agent starts them so): kill each one
            for e in self.events():
                if e["event"] == "run_started" and e["rank"] >= 0:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(int(e["pid"]), signal.SIGKILL)
            # heartbeats, and the snapshots the launcher's own exit removes (a SIGKILL's does not)
            for left in Path("/dev/shm").glob(f"resilient-*-{self.p.pid}"):
                shutil.rmtree(left, ignore_errors=True)
            self.log.close()


def _example(
    cwd: Path, *extra: str, nproc: int = 2, replace: str = "group", launch: tuple[str, ...] = ()
) -> Launch:
    """The example under `resilient launch` (``launch``: more launcher flags; ``extra``: the
    example's); ``replace="group"`` (the whole group restarts after a hard fault) unless a test asks
    for rank replacement (tests/integration/test_replace.py)."""
    return Launch(
        cwd,
        "--standalone", "--nproc-per-node", str(nproc), "--max-restarts", "3", "--monitor-interval", "0.2",
        "--replace", replace, *launch,
        "--heartbeat-timeout", "3", "--startup-timeout", "60", "--backoff-initial", "0",
        EXAMPLE, "--steps", str(STEPS), "--step-ms", "40", "--ckpt-dir", str(cwd / "ck"),
        "--ckpt-every", "4", "--out", str(cwd / "state"), *extra,
    )  # fmt: skip


def _final_states(cwd: Path, nproc: int = 2) -> list[dict[str, Any]]:
    return [torch.load(cwd / "state" / f"rank{r}.pt", weights_only=True) for r in range(nproc)]


def _worker_pid(launch: Launch, rank: int) -> int:
    return int(launch.wait_event("run_started", lambda e: e["rank"] == rank)["pid"])


def _signal_after_checkpoint(
    run: Launch, rank: int, fault: str = "SIGKILL", standby: bool = False, fresh_step: bool = False
) -> int:
    """Once ``rank`` saved a checkpoint of step 8 or later (and, with ``standby``, a warm standby
    waits), send its worker ``fault`` for real; the run must then finish with 0. Returns the pid.
    ``fresh_step``: the checkpoint is one saved after the standby was ready, so the signal lands
    at the start of the step after it (a standby ready mid-step would have it land anywhere)."""
    try:
        since = 0.0
        if standby:  # a warm one: it finished its imports and waits
            ready = run.wait_event("standby_ready")
            since = ready["ts"] if fresh_step else 0.0
        run.wait_event("checkpoint_saved", lambda e: e["step"] >= 8 and e["rank"] == rank and e["ts"] > since)
        victim = _worker_pid(run, rank)
        os.kill(victim, getattr(signal, fault))  # a real kill / a real freeze
        rc = run.finish()
    finally:
        if run.p.poll() is None:
            run.finish(timeout=1)
    assert rc == 0, run.output()
    return victim


# (SIGSTOP with a whole-group relaunch: the slow session; rank replacement covers it in CI)
# (CI's budget: a whole-group relaunch ends bit-exact in test_replace's fallback test)
@pytest.mark.parametrize("fault", [pytest.param(f, marks=pytest.mark.slow) for f in ("SIGKILL", "SIGSTOP")])
def test_hard_fault_relaunches_and_ends_bit_exact(
    tmp_path: Path, fault: str, reference: dict[int, list[dict[str, Any]]]
) -> None:
    run = _example(tmp_path)
    victim = _signal_after_checkpoint(run, 1, fault)
    events = run.events()
    if fault == "SIGKILL":
        died = [e for e in events if e["event"] == "worker_died"]
        assert any(e["pid"] == victim and "SIGKILL" in e["cause"] for e in died), died
    else:
        missed = [e for e in events if e["event"] == "heartbeat_missed"]
        assert missed and missed[0]["pid"] == victim and missed[0]["silent_s"] >= 3, missed
    relaunched = [e for e in events if e["event"] == "relaunched"]
    agent = [(e["event"], e.get("cause"), e.get("global_rank")) for e in events if e["rank"] == -1]
    assert len(relaunched) == 1, agent
    loaded = [e for e in events if e["event"] == "checkpoint_loaded"]
    # the relaunched group resumes from the snapshots its dead workers left in /dev/shm (the agent
    # kept them), which are at least as new as the last committed checkpoint
    restored = [e for e in events if e["event"] == "state_restored" and e["generation"] == 0]
    assert [e["source"] for e in restored] == ["shm", "shm"], restored
    assert restored[0]["step"] == restored[1]["step"] >= 8 and not loaded, restored
    assert_bit_exact(reference[2], _final_states(tmp_path))


# (the slow session: a replacement at 3 ranks, test_replace.py, keeps the DDP layout check in CI)
@pytest.mark.slow
def test_sigkill_at_3_ranks_relaunches_bit_exact(
    tmp_path: Path, reference: dict[int, list[dict[str, Any]]]
) -> None:
    # the relaunched workers' DDP must start with the buckets the dead ones had rebuilt (the
    # layout the run directory keeps): with 3 ranks the ring's sums depend on it
    run = _example(tmp_path, nproc=3)
    _signal_after_checkpoint(run, 2)
    events = run.events()
    assert len([e for e in events if e["event"] == "relaunched"]) == 1
    restored = [e for e in events if e["event"] == "state_restored" and e["generation"] == 0]
    assert len(restored) == 3 and restored[0]["step"] >= 8, restored
    assert_bit_exact(reference[3], _final_states(tmp_path, 3))


@pytest.mark.slow  # (CI's budget: test_replace's GIL hang, replaced alone, stays in CI)
def test_gil_holding_hang_is_caught_by_the_missing_heartbeat(
    tmp_path: Path, reference: dict[int, list[dict[str, Any]]]
) -> None:
    # rank 1 enters a C-level regex backtrack that never releases the GIL, in the first attempt only
    run = _example(tmp_path, "--fault", "gil_hang@10:1", "--fault-attempt", "0")
    rc = run.finish()
    events = run.events()
    assert rc == 0, run.output()
    missed = [e for e in events if e["event"] == "heartbeat_missed"]
    assert len(missed) == 1 and missed[0]["global_rank"] == 1 and missed[0]["silent_s"] >= 3, missed
    assert [e["event"] for e in events].count("relaunched") == 1
    assert_bit_exact(reference[2], _final_states(tmp_path))


@pytest.mark.slow  # (CI's budget: test_replace's kernel OOM-kill stays in CI)
def test_kernel_oom_kill_is_named_and_recovered(
    tmp_path: Path, memory_cgroup: Path, reference: dict[int, list[dict[str, Any]]]
) -> None:
    # rank 1 of the first attempt runs inside a 700 MiB cgroup and touches memory until the kernel kills it
    run = _example(tmp_path, "--fault", "kernel_oom@10:1", "--fault-attempt", "0")
    try:
        victim = _worker_pid(run, 1)
        (memory_cgroup / "cgroup.procs").write_text(str(victim))
        rc = run.finish()
    finally:
        if run.p.poll() is None:
            run.finish(timeout=1)
    events = run.events()
    assert rc == 0, run.output()
    died = [e for e in events if e["event"] == "worker_died" and e["pid"] == victim]
    assert died and died[0]["cause"] == "killed by SIGKILL (OOM-killed by the kernel)", died
    assert [e["event"] for e in events].count("relaunched") == 1
    assert_bit_exact(reference[2], _final_states(tmp_path))


@pytest.mark.parametrize("sig", [pytest.param("SIGUSR1", marks=pytest.mark.slow), "SIGTERM"])  # (CI's budget)
def test_preemption_signal_to_the_launcher_checkpoints_and_exits_requeue(tmp_path: Path, sig: str) -> None:
    # Slurm signals the launcher (srun's task); the workers must write a final checkpoint, not die
    run = _example(tmp_path)
    try:
        run.wait_event("checkpoint_saved", lambda e: e["step"] >= 8 and e["rank"] == 1)
        os.kill(run.p.pid, getattr(signal, sig))
        rc = run.finish()
    finally:
        if run.p.poll() is None:
            run.finish(timeout=1)
    events = run.events()
    assert rc == ExitCode.REQUEUE, run.output()
    pre = [e for e in events if e["event"] == "run_preempted"]
    assert len(pre) == 2 and pre[0]["step"] == pre[1]["step"], pre
    assert not [e for e in events if e["event"] == "relaunched"]
    from resilient.checkpoint.manifest import committed_steps

    assert committed_steps(tmp_path / "ck")[0] == pre[0]["step"]


def _two_nodes(tmp_path: Path, rdzv_id: str, *args: str, nproc: int = 1) -> list[Launch]:
    """Two "nodes": two launchers, one c10d rendezvous on 127.0.0.1, ``nproc`` workers each."""
    from chaos.harness import free_port

    endpoint = f"127.0.0.1:{free_port()}"
    common = ["--nnodes", "2", "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d"]
    common += ["--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id]
    return [Launch(tmp_path / f"node{n}", *common, *args) for n in (0, 1)]


def _finish_all(nodes: list[Launch]) -> list[int]:
    try:
        return [node.finish() for node in nodes]
    finally:
        for node in nodes:
            if node.p.poll() is None:
                node.finish(timeout=1)


def test_two_agents_on_one_machine_form_one_job(
    tmp_path: Path, reference: dict[int, list[dict[str, Any]]]
) -> None:
    nodes = _two_nodes(
        tmp_path, "two-nodes", "--max-restarts", "0",
        EXAMPLE, "--steps", str(STEPS), "--out", str(tmp_path / "state"),
    )  # fmt: skip
    rcs = _finish_all(nodes)
    assert rcs == [0, 0], [node.output() for node in nodes]
    assert_bit_exact(reference[2], _final_states(tmp_path))


# (group: the slow session; a whole group relaunched is test_hard_fault_relaunches_and_ends_bit_exact's)
@pytest.mark.parametrize("replace", [pytest.param("group", marks=pytest.mark.slow), "rank"])
def test_worker_killed_on_one_of_two_nodes_recovers_bit_exact(
    tmp_path: Path, replace: str, reference: dict[int, list[dict[str, Any]]]
) -> None:
    # group: the node whose worker died restarts and re-rendezvouses; the other node restarts
    # because of the membership change, without counting a restart: the launch must still be one
    # for both. rank: the dead rank is replaced on its node alone; the other node's worker stays
    # in its process and no rendezvous happens
    nodes = _two_nodes(
        tmp_path, "kill-one", "--max-restarts", "2", "--monitor-interval", "0.2", "--heartbeat-timeout", "5",
        "--replace", replace,
        EXAMPLE, "--steps", str(STEPS), "--step-ms", "40", "--hang-timeout", "5",
        "--ckpt-dir", str(tmp_path / "ck"), "--ckpt-every", "4", "--out", str(tmp_path / "state"),
    )  # fmt: skip
    try:
        saved = nodes[1].wait_event("checkpoint_saved", lambda e: e["step"] >= 8 and e["rank"] >= 0)
        victim = int(nodes[1].wait_event("run_started", lambda e: e["rank"] == saved["rank"])["pid"])
        os.kill(victim, signal.SIGKILL)
    finally:
        rcs = _finish_all(nodes)
    assert rcs == [0, 0], [node.output() for node in nodes]
    restored = [e for node in nodes for e in node.events() if e["event"] == "state_restored"]
    assert len({e["step"] for e in restored}) == 1 and len(restored) == 2, restored
    if replace == "rank":
        kinds = [[e["event"] for e in node.events() if e["rank"] == -1] for node in nodes]
        assert "rank_replaced" in kinds[1] and "rank_replaced" not in kinds[0], kinds
        assert "relaunched" not in kinds[0] + kinds[1], kinds
        survivor = [e for e in nodes[0].events() if e["event"] == "run_started" and e["rank"] >= 0]
        assert len({e["pid"] for e in survivor}) == 1, survivor  # the other node's worker stayed
    assert_bit_exact(reference[2], _final_states(tmp_path))


@pytest.mark.slow  # (CI's budget: two nodes stay in CI: one node's worker killed, a lost node with a spare)
def test_two_nodes_of_two_ranks_meet_on_node_stores_and_outlive_a_dead_leader(
    tmp_path: Path, reference: dict[int, list[dict[str, Any]]]
) -> None:
    # 2 nodes x 2 ranks: each node's ranks reach the job's store through local rank 0's node store.
    # An exception on one rank is recovered in-process through the node stores; then a node's
    # leader (its local rank 0, which hosts that store) is SIGKILLed: its node peer reports the
    # loss and goes on alone on the job's store, its replacement too, and the run ends bit-exact.
    nodes = _two_nodes(
        tmp_path, "node-link", "--max-restarts", "2", "--monitor-interval", "0.2", "--heartbeat-timeout", "5",
        "--replace", "rank",
        EXAMPLE, "--steps", str(STEPS), "--step-ms", "40", "--hang-timeout", "5",
        "--fault", "exception@5:1", "--fault-attempt", "0",
        "--ckpt-dir", str(tmp_path / "ck"), "--ckpt-every", "4", "--out", str(tmp_path / "state"),
        nproc=2,
    )  # fmt: skip
    try:
        nodes[1].wait_event("checkpoint_saved", lambda e: e["step"] >= 8 and e["rank"] >= 0)
        started = [e for e in nodes[1].events() if e["event"] == "run_started" and e["rank"] >= 0]
        leader = min(e["rank"] for e in started)
        victim = int(next(e["pid"] for e in started if e["rank"] == leader))
        os.kill(victim, signal.SIGKILL)
    finally:
        rcs = _finish_all(nodes)
    assert rcs == [0, 0], [node.output() for node in nodes]
    events = [e for node in nodes for e in node.events()]
    links = [e for e in events if e["event"] == "node_link"]
    first = {}
    for e in links:
        first.setdefault(e["rank"], e)
    assert sorted(first) == [0, 1, 2, 3] and all(e["linked"] for e in first.values()), links
    assert {e["rank"]: e["leader"] for e in first.values()} == {0: 0, 1: 0, 2: 2, 3: 2}
    replacement = [e for e in links if e["rank"] == leader and e["pid"] != victim]
    assert len(replacement) == 1 and not replacement[0]["linked"], replacement
    assert "replaces it" in replacement[0]["reason"]
    lost = [e for e in events if e["event"] == "node_link_lost"]
    assert [e["rank"] for e in lost] == [leader + 1], lost
    faults = [e for e in events if e["event"] == "fault_detected"]
    assert {(e["kind"], e["origin_rank"]) for e in faults if e["generation"] == 0} == {("exception", 1)}, (
        faults
    )
    # (what the injector fired is not training state: the survivors hold their plan, the replacement none)
    for r, (want, got) in enumerate(zip(reference[4], _final_states(tmp_path, 4), strict=True)):
        assert got["fired"] == (
            {"exception@5:1": 1} if r == 1 else {"exception@5:1": 0} if r != leader else {}
        )
        assert_bit_exact(
            {k: v for k, v in want.items() if k != "fired"}, {k: v for k, v in got.items() if k != "fired"}
        )


def test_workers_die_with_a_sigkilled_launcher(tmp_path: Path) -> None:
    import psutil

    run = _example(tmp_path)
    try:
        pids = [_worker_pid(run, r) for r in (0, 1)]
        for pid in pids:  # frozen workers cannot notice the launcher's store going away themselves
            os.kill(pid, signal.SIGSTOP)
        os.kill(run.p.pid, signal.SIGKILL)  # the launcher only: no chance to stop its workers
        run.p.wait()

        def alive() -> list[int]:
            return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]

        wait_until(  # the kernel delivers PDEATHSIG; wait for it
            lambda: not alive(), 20, lambda: f"the workers to die: workers {alive()} outlived their launcher"
        )
    finally:
        run.finish(timeout=1)


def test_fatal_exit_code_is_not_restarted(tmp_path: Path) -> None:
    run = Launch(tmp_path, "--standalone", "--nproc-per-node", "1", "--max-restarts", "3", EXIT_WITH, "3")
    assert run.finish() == ExitCode.FATAL
    assert not [e for e in run.events() if e["event"] == "relaunched"]
    assert not list(run.tmp.glob("torchelastic_*"))  # torch's temporary log dir went with the job


def test_restarts_exhausted_exit_fatal_with_a_summary(tmp_path: Path) -> None:
    run = Launch(
        tmp_path, "--standalone", "--nproc-per-node", "1", "--max-restarts", "2", "--backoff-initial", "0",
        EXIT_WITH, "75",
    )  # fmt: skip
    assert run.finish() == ExitCode.FATAL
    events = run.events()
    assert [e["event"] for e in events].count("relaunched") == 2
    assert "giving up after 2 group restarts" in run.output() and "exit code 75" in run.output()


@pytest.mark.parametrize("window", [None, "0.5"])
def test_restart_window_counts_only_recent_failures(tmp_path: Path, window: str | None) -> None:
    # three failures, each after 1 s of work, with --max-restarts 1: too many for the job as a
    # whole (torchrun's count), but never more than one within a 0.5 s window
    extra = ["--restart-window", window] if window else []
    run = Launch(
        tmp_path, "--standalone", "--nproc-per-node", "1", "--max-restarts", "1", "--backoff-initial", "0",
        "--monitor-interval", "0.1", *extra, FAIL_THEN_SUCCEED, "3", "1.0",
    )  # fmt: skip
    rc = run.finish()
    relaunched = [e["event"] for e in run.events()].count("relaunched")
    if window is None:
        assert rc == ExitCode.FATAL and relaunched == 1, run.output()
    else:
        assert rc == 0 and relaunched == 3, run.output()


# (the whole-group variant runs in the slow session, to keep CI within its budget)
@pytest.mark.parametrize("replace", [pytest.param("group", marks=pytest.mark.slow), "rank"])
def test_hard_fault_at_the_same_step_every_launch_stops_fatal(tmp_path: Path, replace: str) -> None:
    # rank 1 holds the GIL at step 10 in every process (no --fault-attempt): the runtime's own repeat
    # guard dies with each process, so the agent must see the repetition and stop, not loop, whether
    # it restarts the group or replaces the rank
    run = _example(tmp_path, "--fault", "gil_hang@10:1", replace=replace)
    rc = run.finish()
    events = [e["event"] for e in run.events()]
    assert rc == ExitCode.FATAL, run.output()
    assert events.count("relaunched" if replace == "group" else "rank_replaced") == 2, run.output()
    assert "rank 1 died at step 10 3 times in a row" in run.output()


def test_same_start_up_failure_every_launch_stops_fatal(tmp_path: Path) -> None:
    # a worker that fails before its first step with the same exit code every launch (an import
    # error, a bad argument) is not relaunched until --max-restarts runs out
    run = Launch(
        tmp_path, "--standalone", "--nproc-per-node", "1", "--max-restarts", "20", "--backoff-initial", "0",
        "--monitor-interval", "0.1", EXIT_WITH, "1",
    )  # fmt: skip
    rc = run.finish()
    assert rc == ExitCode.FATAL, run.output()
    assert [e["event"] for e in run.events()].count("relaunched") == 2, run.output()
    assert "rank 0 died at start-up (exit code 1) 3 times in a row" in run.output()
