"""`resilient launch` under a real Slurm (tests/integration/slurm_cluster.py: slurmctld and two
slurmd on this machine): `sbatch examples/slurm.sbatch`, one launcher per node, ends where a
fault-free torchrun run of the same example ends, bit for bit.

Not in CI (`-m "not slow and not slurm"`): `nox -s slurm` runs them (the packages install once,
~35 s; the cluster starts in ~5 s; each job ~30-60 s on 2 cores)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from chaos.harness import free_port
from tests.integration.conftest import EXAMPLE, STEPS, assert_bit_exact
from tests.integration.slurm_cluster import NODES, SlurmCluster

# (the first test also pays for the install, ~35 s, and the cluster start)
pytestmark = [pytest.mark.slurm, pytest.mark.integration, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "examples" / "slurm.sbatch"
JOB_TIMEOUT = 240.0  # two launchers, their workers' imports and 24 steps, on a shared 2-core machine


@pytest.fixture(scope="module")
def torchrun_reference(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The fault-free final states of the example under plain torchrun, by world size (lazily)."""

    class Ref(dict):  # type: ignore[type-arg]
        def __missing__(self, world: int) -> list[dict[str, Any]]:
            d = tmp_path_factory.mktemp(f"torchrun{world}")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                   EXAMPLE, "--steps", str(STEPS), "--out", str(d / "state")]  # fmt: skip
            env = {**os.environ, "OMP_NUM_THREADS": "1", "RESILIENT_RUN_ID": "torchrun"}
            r = subprocess.run(cmd, cwd=d, env=env, capture_output=True, text=True, timeout=180,
                               start_new_session=True)  # fmt: skip
            assert r.returncode == 0, r.stderr[-3000:]
            self[world] = [torch.load(d / "state" / f"rank{i}.pt", weights_only=True) for i in range(world)]
            return self[world]

    return Ref()


def test_cluster_runs_a_job_on_both_nodes_and_accounts_for_it(
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


def _with_our_bin(cluster: SlurmCluster) -> str:
    """The job's PATH: this interpreter's `resilient` first (pytest may run outside the venv's PATH)."""
    return f"{Path(sys.executable).parent}:{cluster.env['PATH']}"


@pytest.mark.parametrize("nproc", [1, 2], ids=["2x1", "2x2"])
def test_sbatch_srun_resilient_launch_matches_torchrun(
    slurm_cluster: SlurmCluster, torchrun_reference: Any, tmp_path: Path, nproc: int
) -> None:
    # The user's script as written: one launcher per node (srun), the rendezvous on the first node
    # from Slurm's variables; what follows the script name are `resilient launch`'s arguments.
    # (No standby: 2 cores hold 2 launchers and their workers already.)
    job = slurm_cluster.sbatch(
        SBATCH,
        "--nproc-per-node", str(nproc), "--standby", "0", "--monitor-interval", "0.2",
        "--max-restarts", "2", EXAMPLE, "--steps", str(STEPS), "--out", str(tmp_path / "state"),
        "--ckpt-dir", str(tmp_path / "ck"), "--ckpt-every", "4",
        cwd=tmp_path,
        options=["--time=10", f"--output={tmp_path / 'slurm-%j.out'}"],
        env={"RDZV_PORT": str(free_port()), "OMP_NUM_THREADS": "1", "PATH": _with_our_bin(slurm_cluster)},
    )  # fmt: skip
    info = slurm_cluster.wait_job(job, JOB_TIMEOUT)
    log = (tmp_path / f"slurm-{job}.out").read_text()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "0"), log[-4000:]
    assert "training finished" in log
    # one task (a launcher) on each node, in the one step
    steps = {row["JobID"]: row for row in slurm_cluster.sacct(job)}
    assert (steps[f"{job}.0"]["NodeList"], steps[f"{job}.0"]["NTasks"]) == ("n[1-2]", "2"), steps
    world = 2 * nproc
    finals = [torch.load(tmp_path / "state" / f"rank{r}.pt", weights_only=True) for r in range(world)]
    for rank in range(world):
        assert assert_bit_exact(torchrun_reference[world][rank], finals[rank]) > 20, rank


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
