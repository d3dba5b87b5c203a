"""One training job of examples/slurm.sbatch on the test cluster (slurm_cluster.py): submitted as a
user submits it, watched through the example's progress lines, the run's event log and Slurm's own
accounting, and compared with a fault-free run of the same job."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from chaos.compare import assert_bit_exact
from chaos.harness import free_port
from resilient.events import read_events
from tests._wait import wait_until
from tests.integration.slurm_cluster import SlurmCluster

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "examples" / "slurm.sbatch"
EXAMPLE = str(ROOT / "examples" / "train_tiny.py")
# (no standby: 2 cores hold 2 launchers and their workers already)
LAUNCH_ARGS = ("--standby", "0", "--monitor-interval", "0.2", "--max-restarts", "2")
FAILED = frozenset({"FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"})


@dataclass
class TrainingJob:
    """``sbatch examples/slurm.sbatch <launch args> train_tiny.py ...`` from ``dir``, its checkpoints
    (``dir/ck``: the shared disk, both nodes being this host), progress and final states there too."""

    cluster: SlurmCluster
    dir: Path
    nproc: int
    steps: int
    id: int = 0
    submitted: float = 0.0
    seconds: float | None = None  # submission to its end, every run of it
    extra: list[str] = field(default_factory=list)

    @property
    def world(self) -> int:
        return 2 * self.nproc

    @classmethod
    def submit(
        cls,
        cluster: SlurmCluster,
        dir: Path,
        nproc: int,
        steps: int,
        *script_args: str,
        limit: str = "10",
        options: tuple[str, ...] = (),
        spares: int = 0,
    ) -> TrainingJob:
        """``spares``: nodes of the allocation beyond the job's two that park as spares
        (``SPARE_NODES``; the allocation's size and ``--no-kill`` go in ``options``)."""
        job = cls(cluster, dir, nproc, steps)
        # (every node idle first: the job gets the first two, whatever the previous test left)
        wait_until(lambda: set(cluster.node_states().values()) == {"idle"}, 120,
                   lambda: f"every node idle: {cluster.node_states()}", interval=0.5)  # fmt: skip
        args = [*LAUNCH_ARGS, "--nproc-per-node", str(nproc), EXAMPLE, "--steps", str(steps),
                "--out", str(dir / "state"), "--ckpt-dir", str(dir / "ck"), "--ckpt-every", "4",
                "--progress", str(dir / "progress.jsonl"), *script_args]  # fmt: skip
        env = {
            "RDZV_PORT": str(free_port()), "OMP_NUM_THREADS": "1",
            # this interpreter's `resilient` first (pytest may run outside the venv's PATH)
            "PATH": f"{Path(sys.executable).parent}:{cluster.env['PATH']}",
            "SPARE_NODES": str(spares),
        }  # fmt: skip
        job.submitted = time.monotonic()
        options = (f"--time={limit}", f"--output={dir / 'slurm-%j.out'}", *options)
        job.id = cluster.sbatch(SBATCH, *args, cwd=dir, env=env, options=options)
        return job

    # --- what it did --------------------------------------------------------------------------

    def log(self) -> str:
        path = self.dir / f"slurm-{self.id}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def nodes(self) -> list[str]:
        """The nodes of its current (or last) run, in order: the first hosts ranks 0.., the rendezvous."""
        names = self.cluster.run("scontrol", "show", "hostnames", self.cluster.job(self.id)["NodeList"])
        return names.stdout.split()

    def progress(self) -> list[dict[str, Any]]:
        """A line per rank per completed step: t, step, rank, pid, attempt."""
        return read_events(self.dir / "progress.jsonl")

    def events(self) -> list[dict[str, Any]]:
        """Every run's events, the launchers' and the workers' (one log: run id slurm-<job id>)."""
        return read_events(self.dir / "resilient_runs" / f"slurm-{self.id}" / "events.jsonl")

    def of(self, event: str, *, workers: bool = True) -> list[dict[str, Any]]:
        return [e for e in self.events() if e["event"] == event and (e["rank"] >= 0) == workers]

    def reached(self, step: int, timeout: float, rank: int | None = None) -> dict[str, Any]:
        """The first progress line at ``step`` or later (of ``rank``), once there is one."""

        def found() -> dict[str, Any] | None:
            info = self.cluster.job(self.id)
            assert info["JobState"] not in FAILED, f"job {self.id} {info['JobState']}:\n{self.log()[-3000:]}"
            return next((p for p in self.progress() if p["step"] >= step and rank in (None, p["rank"])), None)

        what = lambda: f"job {self.id} to reach step {step}:\n{self.log()[-3000:]}"  # noqa: E731
        return wait_until(found, timeout, what, interval=0.2)

    def wait_completed(self, timeout: float) -> dict[str, str]:
        """Its fields once it completed; fails at once if it ended otherwise. A requeued job
        (PREEMPTED, NODE_FAIL) runs again: those are not its end."""

        def completed() -> dict[str, str] | None:
            info = self.cluster.job(self.id)
            assert info["JobState"] not in FAILED, f"job {self.id} {info['JobState']}:\n{self.log()[-4000:]}"
            return info if info["JobState"] == "COMPLETED" else None

        what = lambda: f"job {self.id} to complete: {self.cluster.job(self.id)}\n{self.log()[-4000:]}"  # noqa: E731
        info = wait_until(completed, timeout, lambda: f"{what()}\n{self.cluster.logs()}", interval=0.5)
        self.seconds = time.monotonic() - self.submitted
        return info

    def runs(self, timeout: float = 60.0) -> list[dict[str, str]]:
        """Slurm's accounting of each run of the job (``sacct -D -X``), once the last one is there
        as COMPLETED (slurmctld sends it to slurmdbd after the job ended)."""
        fields = "JobID,State,ExitCode,NodeList,Start,End"

        def accounted() -> list[dict[str, str]] | None:
            rows = self.cluster.sacct(self.id, fields, "-X")
            return rows if rows and rows[-1]["State"] == "COMPLETED" else None

        return wait_until(accounted, timeout, lambda: f"sacct to show job {self.id} COMPLETED: "
                          f"{self.cluster.sacct(self.id, fields, '-X')}", interval=0.5)  # fmt: skip

    def assert_matches(self, reference: list[dict[str, Any]]) -> None:
        """Every rank's final model and optimizer equal the fault-free run's, bit for bit."""
        for rank in range(self.world):
            final = torch.load(self.dir / "state" / f"rank{rank}.pt", weights_only=True)
            parts = ("model", "optimizer")  # (not what the injector fired: the reference fired nothing)
            n = sum(assert_bit_exact(reference[rank][k], final[k], f"rank{rank}/{k}") for k in parts)
            assert n > 50, rank  # (parameters and Adam moments were really compared)

    def node_of(self, rank: int) -> str:
        """The node ``rank`` ran on first (the rendezvous, not Slurm, numbers the nodes)."""
        started = next(e for e in self.of("run_started") if e["rank"] == rank)
        return str(self.slurm_of(started)["node"])

    def slurm_of(self, record: dict[str, Any]) -> dict[str, Any]:
        """The Slurm place an event names (every record under Slurm names one)."""
        place = record.get("slurm")
        assert place is not None and place["job"] == str(self.id), record
        return place
