"""`resilient launch` under a real Slurm (tests/integration/slurm_cluster.py: slurmctld, slurmdbd and
three slurmd on this machine): `sbatch examples/slurm.sbatch`, one launcher per node, with the faults
a Slurm user meets, each ending where a fault-free torchrun run of the same job ends, bit for bit:

- a rank's exception and a hang: recovered in-process; Slurm never knows (one run, no requeue);
- a worker SIGKILLed: its launcher replaces the rank; no requeue;
- `scontrol requeue` and a preemption (a job of a higher partition, PreemptMode=REQUEUE): the
  final checkpoint is committed before the grace ends, the requeued job resumes at that step;
- the time limit (`--time=1 --signal=B:USR1@30`): the same, the script requeueing itself;
- a node lost (its slurmd and every process of the job there killed at once): Slurm marks it
  DOWN, ends the job (NODE_FAIL) and requeues it on the two nodes that are up; it resumes from
  the newest checkpoint.

Each at 2 nodes x 1 rank and 2 nodes x 2 ranks. Not in CI (`-m "not slow and not slurm"`):
`nox -s slurm` runs them (the packages install once, ~35 s; the cluster starts in ~5 s)."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest
import torch

from resilient.cli import main as resilient_cli
from resilient.metrics import account
from tests.integration.conftest import EXAMPLE, STEPS
from tests.integration.slurm_cluster import NODES, PREEMPT_GRACE_S, SlurmCluster
from tests.integration.slurm_job import TrainingJob

# (the first test also pays for the install, ~35 s, and the cluster start)
pytestmark = [pytest.mark.slurm, pytest.mark.integration, pytest.mark.timeout(600)]
JOB_TIMEOUT = 240.0  # two launchers, their workers' imports and the steps, on a shared 2-core machine
REQUEUED_TIMEOUT = 360.0  # ... twice, and the requeued job's wait (cred_expire, 10 s) between
KILL_WAIT_S = 30  # slurm.conf's KillWait: a requeue's grace before SIGKILL
TOPOLOGY = pytest.mark.parametrize("nproc", [1, 2], ids=["2x1", "2x2"])


@pytest.fixture(scope="module")
def torchrun_reference(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The fault-free final states of the example under plain torchrun, by (world size, steps)."""

    class Ref(dict):  # type: ignore[type-arg]
        def __missing__(self, key: tuple[int, int]) -> list[dict[str, Any]]:
            world, steps = key
            d = tmp_path_factory.mktemp(f"torchrun{world}x{steps}")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                   EXAMPLE, "--steps", str(steps), "--out", str(d / "state")]  # fmt: skip
            env = {**os.environ, "OMP_NUM_THREADS": "1", "RESILIENT_RUN_ID": "torchrun"}
            r = subprocess.run(cmd, cwd=d, env=env, capture_output=True, text=True, timeout=180,
                               start_new_session=True)  # fmt: skip
            assert r.returncode == 0, r.stderr[-3000:]
            self[key] = [torch.load(d / "state" / f"rank{i}.pt", weights_only=True) for i in range(world)]
            return self[key]

    return Ref()


def report(case: str, job: TrainingJob, **figures: Any) -> None:
    """One line per case with its run time (the figures in docs/launcher.md#slurm come from here)."""
    extra = "".join(f", {k} {v:.1f} s" if isinstance(v, float) else f", {k} {v}" for k, v in figures.items())
    print(f"\n[slurm] {case} {job.nproc * 2} ranks: job {job.id}, {job.seconds:.1f} s submit to end{extra}")


def test_cluster_runs_a_job_on_two_nodes_and_accounts_for_it(
    slurm_cluster: SlurmCluster, wait_until: Any
) -> None:
    assert slurm_cluster.node_states() == dict.fromkeys(NODES, "idle")
    r = slurm_cluster.run("srun", "-N2", "-l", "--job-name=both-nodes", "printenv", "SLURMD_NODENAME",
                          timeout=60)  # fmt: skip
    assert sorted(r.stdout.splitlines()) == ["0: n1", "1: n2"], r.stdout + r.stderr

    def accounted() -> str:  # (slurmctld sends the record to slurmdbd after the job has ended)
        cmd = ["sacct", "-n", "-X", "-P", "--name=both-nodes", "-o", "State,NodeList"]
        out = slurm_cluster.run(*cmd).stdout
        return out if out.split() == ["COMPLETED|n[1-2]"] else ""

    wait_until(accounted, 30, "sacct to show the job COMPLETED on n[1-2]")


@TOPOLOGY
def test_sbatch_srun_resilient_launch_matches_torchrun(
    slurm_cluster: SlurmCluster, torchrun_reference: Any, tmp_path: Path, nproc: int
) -> None:
    job = TrainingJob.submit(slurm_cluster, tmp_path, nproc, STEPS)
    info = job.wait_completed(JOB_TIMEOUT)
    assert (info["ExitCode"], info["Restarts"]) == ("0:0", "0"), job.log()[-4000:]
    assert "training finished" in job.log()
    # one task (a launcher) on each node, in the one step
    steps = {row["JobID"]: row for row in slurm_cluster.sacct(job.id)}
    assert (steps[f"{job.id}.0"]["NodeList"], steps[f"{job.id}.0"]["NTasks"]) == ("n[1-2]", "2"), steps
    job.assert_matches(torchrun_reference[job.world, STEPS])
    report("fault-free", job)


@TOPOLOGY
def test_an_exception_and_a_hang_are_recovered_in_process_and_slurm_never_knows(
    slurm_cluster: SlurmCluster, torchrun_reference: Any, tmp_path: Path, nproc: int
) -> None:
    last = 2 * nproc - 1  # (the last rank and rank 0 run on different nodes)
    plan = f"exception@6:{last},hang@14:0"
    job = TrainingJob.submit(slurm_cluster, tmp_path, nproc, STEPS, "--fault", plan, "--hang-timeout", "2")
    info = job.wait_completed(JOB_TIMEOUT)
    assert (info["ExitCode"], info["Restarts"]) == ("0:0", "0"), job.log()[-4000:]
    assert [r["State"] for r in job.runs()] == ["COMPLETED"]  # one run: no requeue
    faults = job.of("fault_detected")
    own = {f["kind"]: f for f in faults if f["rank"] == f["origin_rank"]}
    assert set(own) == {"exception", "hang"}, faults
    raised, hung = job.node_of(last), job.node_of(0)
    assert {raised, hung} == set(job.nodes())
    assert job.slurm_of(own["exception"]) == {"job": str(job.id), "step": "0", "node": raised, "requeues": 0}
    assert job.slurm_of(own["hang"])["node"] == hung
    assert not job.of("worker_died", workers=False)
    out, run_dir = io.StringIO(), tmp_path / "resilient_runs" / f"slurm-{job.id}"
    with redirect_stdout(out):
        assert resilient_cli(["events", str(run_dir), "--faults"]) == 0
    for node in (raised, hung):
        assert f"(Slurm job {job.id}.0 on {node})" in out.getvalue(), out.getvalue()
    job.assert_matches(torchrun_reference[job.world, STEPS])
    report("exception + hang", job)


@TOPOLOGY
def test_a_sigkilled_rank_is_replaced_by_its_launcher_without_a_requeue(
    slurm_cluster: SlurmCluster, torchrun_reference: Any, tmp_path: Path, nproc: int
) -> None:
    steps, last = 40, 2 * nproc - 1
    job = TrainingJob.submit(slurm_cluster, tmp_path, nproc, steps, "--step-ms", "150")
    victim = job.reached(10, JOB_TIMEOUT, rank=last)
    os.kill(victim["pid"], signal.SIGKILL)
    info = job.wait_completed(JOB_TIMEOUT)
    assert (info["ExitCode"], info["Restarts"]) == ("0:0", "0"), job.log()[-4000:]
    assert [r["State"] for r in job.runs()] == ["COMPLETED"]
    (died,) = job.of("worker_died", workers=False)
    assert died["pid"] == victim["pid"] and "SIGKILL" in died["cause"]
    where = job.node_of(last)
    assert job.slurm_of(died)["node"] == where
    (replaced,) = job.of("rank_replaced", workers=False)
    assert replaced["global_rank"] == last and job.slurm_of(replaced)["node"] == where
    job.assert_matches(torchrun_reference[job.world, steps])
    report("SIGKILL of a rank", job)


def assert_requeued_at_its_final_checkpoint(job: TrainingJob, asked: float, grace_s: float) -> dict[str, Any]:
    """A preemption as the operator wants it: every rank committed a final checkpoint within the
    grace after it was asked to stop, and the next run of the job resumed at exactly that step; Slurm
    accounts a requeue, and the events a preemption (no failure). Returns the figures."""
    runs = job.runs()
    assert len(runs) >= 2 and all(r["State"] in ("REQUEUED", "PREEMPTED") for r in runs[:-1]), runs
    preempted = job.of("run_preempted")
    first = [e for e in preempted if job.slurm_of(e)["requeues"] == 0]
    assert sorted(e["rank"] for e in first) == list(range(job.world)), preempted
    (step,) = {e["step"] for e in first}
    assert "final checkpoint at step" in first[0]["error"], first[0]
    committed = max(e["ts"] for e in first) - asked
    assert committed < grace_s, f"final checkpoint {committed:.1f} s after the signal (grace {grace_s} s)"
    loaded = [e for e in job.of("checkpoint_loaded") if job.slurm_of(e)["requeues"] == 1]
    assert sorted(e["rank"] for e in loaded) == list(range(job.world)), job.of("checkpoint_loaded")
    assert {e["step"] for e in loaded} == {step}, (loaded, step)
    assert not job.of("run_failed") and not job.of("run_failed", workers=False)
    assert account(job.events()).incidents == []  # (a preemption is no fault)
    resumed = min(e["ts"] for e in loaded)
    return {"final checkpoint after": committed, "at step": step, "resumed after": resumed - asked}


@TOPOLOGY
def test_scontrol_requeue_resumes_at_the_final_checkpoint(
    slurm_cluster: SlurmCluster, torchrun_reference: Any, tmp_path: Path, nproc: int
) -> None:
    steps = 40
    job = TrainingJob.submit(slurm_cluster, tmp_path, nproc, steps, "--step-ms", "200")
    job.reached(12, JOB_TIMEOUT)
    asked = time.time()
    slurm_cluster.run("scontrol", "requeue", str(job.id))  # (SIGTERM to every process of the job)
    info = job.wait_completed(REQUEUED_TIMEOUT)
    assert (info["ExitCode"], info["Restarts"]) == ("0:0", "1"), job.log()[-4000:]
    assert "Slurm requeues the job" in job.log()  # (the script leaves it to Slurm)
    figures = assert_requeued_at_its_final_checkpoint(job, asked, KILL_WAIT_S)
    job.assert_matches(torchrun_reference[job.world, steps])
    report("scontrol requeue", job, **figures)


@TOPOLOGY
def test_a_preemption_by_a_higher_partition_resumes_at_the_final_checkpoint(
    slurm_cluster: SlurmCluster, torchrun_reference: Any, tmp_path: Path, nproc: int
) -> None:
    steps = 40
    job = TrainingJob.submit(slurm_cluster, tmp_path, nproc, steps, "--step-ms", "200")
    job.reached(12, JOB_TIMEOUT)
    urgent = tmp_path / "urgent.sbatch"
    urgent.write_text("#!/bin/bash\nsrun sleep 3\n")
    asked = time.time()
    # a job of partition `urgent` (PriorityTier 10) needs both of its nodes: Slurm preempts it
    options = ["--partition=urgent", "-N2", "--nodelist=n1,n2", "--exclusive", f"--output={urgent}.out"]
    preemptor = slurm_cluster.sbatch(urgent, cwd=tmp_path, options=options)
    info = job.wait_completed(REQUEUED_TIMEOUT)
    assert (info["ExitCode"], info["Restarts"]) == ("0:0", "1"), job.log()[-4000:]
    assert slurm_cluster.job(preemptor)["JobState"] == "COMPLETED"
    figures = assert_requeued_at_its_final_checkpoint(job, asked, PREEMPT_GRACE_S)
    job.assert_matches(torchrun_reference[job.world, steps])
    report("preemption (PreemptMode=REQUEUE)", job, **figures)


@TOPOLOGY
def test_the_time_limit_ends_each_run_in_a_final_checkpoint_and_a_requeue(
    slurm_cluster: SlurmCluster, torchrun_reference: Any, tmp_path: Path, nproc: int
) -> None:
    # Slurm looks at time limits every 30 s: the warning comes 30-60 s into a run, the limit is 60 s.
    # 56 steps of 1 s are more than one run holds.
    steps = 56
    job = TrainingJob.submit(slurm_cluster, tmp_path, nproc, steps, "--step-ms", "1000", limit="1",
                             options=("--signal=B:USR1@30",))  # fmt: skip
    info = job.wait_completed(480.0)
    assert info["ExitCode"] == "0:0" and int(info["Restarts"]) >= 1, job.log()[-4000:]
    runs = job.runs()
    assert all(r["State"] == "REQUEUED" for r in runs[:-1]), runs  # (never TIMEOUT: each run stopped in time)
    preempted = job.of("run_preempted")
    loaded = job.of("checkpoint_loaded")
    for n in range(len(runs) - 1):  # each run resumed where the one before it stopped
        stopped = {e["step"] for e in preempted if job.slurm_of(e)["requeues"] == n}
        resumed = {e["step"] for e in loaded if job.slurm_of(e)["requeues"] == n + 1}
        assert len(stopped) == 1 and resumed == stopped, (n, stopped, resumed)
    assert "preempted: final checkpoint committed; requeueing" in job.log()
    job.assert_matches(torchrun_reference[job.world, steps])
    report("time limit", job, runs=len(runs))


@TOPOLOGY
def test_a_lost_node_ends_the_job_and_slurm_requeues_it_on_the_nodes_that_are_up(
    slurm_cluster: SlurmCluster, torchrun_reference: Any, tmp_path: Path, nproc: int
) -> None:
    steps = 40
    job = TrainingJob.submit(slurm_cluster, tmp_path, nproc, steps, "--step-ms", "200")
    job.reached(12, JOB_TIMEOUT)
    second = job.nodes()[1]  # (the batch script and the rendezvous stay on the first)
    lost = time.time()
    try:
        assert slurm_cluster.lose_node(second) >= 3  # slurmd, slurmstepd, the task, its launcher, ...
        info = job.wait_completed(REQUEUED_TIMEOUT)
    finally:
        slurm_cluster.restore_node(second)
    assert (info["ExitCode"], info["Restarts"]) == ("0:0", "1"), job.log()[-4000:]
    runs = job.runs()
    assert [r["State"] for r in runs] == ["NODE_FAIL", "COMPLETED"], runs
    assert second not in job.nodes() and len(job.nodes()) == 2, runs  # (DOWN: Slurm gave it the spare)
    loaded = [e for e in job.of("checkpoint_loaded") if job.slurm_of(e)["requeues"] == 1]
    assert sorted(e["rank"] for e in loaded) == list(range(job.world)), job.of("checkpoint_loaded")
    (step,) = {e["step"] for e in loaded}  # the newest checkpoint committed before the loss
    resumed = min(e["ts"] for e in loaded) - lost
    job.assert_matches(torchrun_reference[job.world, steps])
    report("node lost", job, **{"resumed at step": step, "resumed after": resumed})


def _spare_job_stepping(cluster: SlurmCluster, run_dir: Path, steps: int, wait_until: Any) -> TrainingJob:
    """The job of three nodes, one of them its spare, submitted and past its step 12."""
    run_dir.mkdir()
    three = ("--nodes=3", "--no-kill")
    job = TrainingJob.submit(cluster, run_dir, 1, steps, "--step-ms", "200", options=three, spares=1)
    parked = lambda: job.of("spare_parked", workers=False)  # noqa: E731
    wait_until(parked, JOB_TIMEOUT, lambda: f"a launcher parked as the spare:\n{job.log()[-3000:]}")
    job.reached(12, JOB_TIMEOUT)
    return job


def _a_spare_job_whose_rank_1_is_off_the_head(
    cluster: SlurmCluster, tmp_path: Path, steps: int, wait_until: Any
) -> tuple[TrainingJob, str]:
    """The job of three nodes (one a spare) once it stepped, and the node holding rank 1. The first
    node hosts the rendezvous' store and group rank 0's agent the workers': losing either ends a
    job (docs/limits.md). Where the ranks land is the rendezvous' to say: a run that put rank 1
    on the first node is cancelled and the job submitted again (at most three times)."""
    for attempt in range(3):
        job = _spare_job_stepping(cluster, tmp_path / f"run{attempt}", steps, wait_until)
        victim = job.node_of(1)
        if victim != job.nodes()[0]:
            return job, victim
        cluster.run("scancel", str(job.id), check=False)
        gone = lambda j=job: cluster.job(j.id)["JobState"] not in ("RUNNING", "COMPLETING")  # noqa: E731
        wait_until(gone, 60, f"job {job.id} cancelled")
    pytest.fail("the rendezvous put rank 1 on the first node three times")


def test_a_lost_node_with_a_spare_in_the_allocation_keeps_the_job_running(
    slurm_cluster: SlurmCluster, torchrun_reference: Any, tmp_path: Path, wait_until: Any
) -> None:
    # three nodes allocated, two train (SPARE_NODES=1): the launcher that arrives last parks as
    # their spare. The node holding rank 1 loses power; the spare takes its seat, rank 0 keeps its
    # process, and with --no-kill Slurm does not end the job when it marks the node DOWN.
    steps = 40
    job, victim = _a_spare_job_whose_rank_1_is_off_the_head(slurm_cluster, tmp_path, steps, wait_until)
    pid0 = next(e["pid"] for e in job.of("run_started") if e["rank"] == 0)
    lost = time.time()
    try:
        assert slurm_cluster.lose_node(victim) >= 3
        info = job.wait_completed(JOB_TIMEOUT)
    finally:
        slurm_cluster.restore_node(victim)
    assert (info["ExitCode"], info["Restarts"]) == ("0:0", "0"), job.log()[-4000:]
    # (Slurm resizes a --no-kill job to the nodes left when it marks one DOWN: never NODE_FAIL)
    assert [r["State"] for r in job.runs()] in (["COMPLETED"], ["RESIZING", "COMPLETED"]), job.runs()
    (taken,) = job.of("seat_taken", workers=False)
    assert taken["ranks"] == [1], taken
    assert [e["pid"] for e in job.of("run_started") if e["rank"] == 0] == [pid0]  # never restarted
    pid1 = next(e["pid"] for e in job.of("run_started") if e["rank"] == 1)  # (the lost node's)
    back = min(p["t"] for p in job.progress() if p["rank"] == 1 and p["pid"] != pid1) - lost
    job.assert_matches(torchrun_reference[job.world, steps])
    report("node lost, a spare in the allocation", job, **{"rank 1 stepping after": back})


def test_teardown_leaves_no_process_even_when_the_test_fails(
    slurm_cluster: SlurmCluster, tmp_path: Path, wait_until: Any
) -> None:
    # (slurm_cluster: Slurm installs and starts here; this test starts and ends a cluster of its own)
    script = tmp_path / "sleep.sbatch"
    script.write_text("#!/bin/bash\nsrun -N2 sleep 300\n")
    cluster = SlurmCluster(tmp_path / "c")
    with pytest.raises(ZeroDivisionError), cluster:
        cluster.start()
        job = cluster.sbatch(script, cwd=tmp_path, options=["-N2", f"--output={tmp_path / 'out'}"])
        sleeps = lambda: [p for p in cluster.leftovers() if p.name() == "sleep"]  # noqa: E731
        wait_until(lambda: len(sleeps()) == 2, 60, lambda: f"job {job}'s sleep on both nodes")
        daemons = list(cluster.daemons.values())
        _ = 1 / 0  # the test fails while its job runs
    assert all(p.poll() is not None for p in daemons)
    assert cluster.leftovers() == [], cluster.leftovers()
