"""The faults the harness does to a running job (everything the runtime cannot fire in-process):
SIGKILL/SIGSTOP, a kernel OOM-kill (the rank moved into a memory cgroup just before its in-process
allocation), a slow disk (its writes throttled by a blkio cgroup), a dropped or lossy link (the rank
runs behind a veth link of its own), a corrupt newest checkpoint (the whole job killed, bytes
flipped, the job started again on the same directory). Each one fires when the event log shows
the target rank reached the fault's step; used by ``chaos certify`` (one fault per job) and by
``chaos run`` / ``chaos stream`` (many).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from chaos.cgroup import blkio_cgroup, release_blkio
from chaos.job import Job, record_injection
from chaos.netns import VethLink
from chaos.schedule import LINK, Certification, Planned
from resilient.events import EventTail

HARNESS = ("sigkill", "sigstop", "corrupt_checkpoint", "slow_disk", "kernel_oom", *LINK)


class Tail:
    """The job's event logs, read incrementally (a soak's log grows to ~10^5 lines: reading all of
    it on every poll would make the harness late for the faults it places)."""

    def __init__(self, cwd: Path) -> None:
        self.cwd = cwd
        self._tail = EventTail(cwd / "resilient_runs")
        self.reached: dict[int, tuple[int, int]] = {}  # rank → (newest step completed, its pid)

    def poll(self) -> None:
        for e in self._tail.poll():
            if e["event"] == "step_completed":
                self.reached[e["rank"]] = (e["step"], e["pid"])
            elif e["event"] == "run_started" and e["rank"] >= 0:  # a new process: from its start
                self.reached[e["rank"]] = (-1, e["pid"])


@dataclass
class Runner:
    """One job and the harness's faults on it; ``job`` is replaced when a fault restarts it."""

    cert: Certification
    cwd: Path
    plan: str  # the in-process faults (chaos/inject.py), fired by the runtime
    deadline: float
    link: VethLink | None = None
    attempt: str | None = None  # "0": in-process faults only in the first launch attempt
    memcg: Path | None = None  # kernel_oom: the memory cgroup the target rank is moved into
    skipped: list[str] = field(default_factory=list)
    job: Job = field(init=False)
    tail: Tail = field(init=False)

    def __post_init__(self) -> None:
        self.job = Job(self.cert, self.cwd, self.plan, attempt=self.attempt, link=self.link)
        self.tail = Tail(self.cwd)

    def wait_rank(self, rank: int, step: int) -> tuple[int, int] | None:
        """(step, pid) once ``rank`` completed ``step`` or later; None if the job ended first."""
        while time.monotonic() < self.deadline and self.job.p.poll() is None:
            self.tail.poll()
            got = self.tail.reached.get(rank)
            if got is not None and got[0] >= step:
                return got
            time.sleep(0.02)
        return None

    def fire(self, step: int, f: Planned) -> float | None:
        """Do ``f`` when its rank reaches ``step``. Returns when a fault with a duration ended (the
        link back, the disk unthrottled), else None."""
        lead = 3 if f.fault == "kernel_oom" else 1  # into the cgroup a few steps before it allocates
        hit = self.wait_rank(f.rank, step - lead)
        if hit is None:
            return None
        done, pid = hit
        try:
            if f.fault in ("sigkill", "sigstop"):
                os.kill(pid, getattr(signal, f.fault.upper()))
                record_injection(self.cwd, f.fault, f.rank, done + 1, pid=pid)
            elif f.fault == "kernel_oom":
                if self.memcg is None:
                    self.skipped.append("kernel_oom: no memory cgroup")
                else:
                    (self.memcg / "cgroup.procs").write_text(str(pid))  # the runtime then allocates
            elif f.fault == "slow_disk":
                return self._slow_disk(f, done, pid)
            elif f.fault in LINK:
                return self._link(f, done, pid)
            elif f.fault == "corrupt_checkpoint":
                self._corrupt()
        except (ProcessLookupError, OSError):
            pass  # gone already (another fault's relaunch): not injected, not counted
        return None

    def _lasts(self, seconds: float) -> float:
        with contextlib.suppress(subprocess.TimeoutExpired):  # the fault lasts this long by definition
            self.job.p.wait(seconds)
        return time.time()

    def _link(self, f: Planned, done: int, pid: int) -> float:
        link = self.link
        assert link is not None, "a link fault needs the job started behind a VethLink"
        pct = f.arg if f.arg is not None else 30.0
        extra = {"loss_pct": pct} if f.fault == "link_loss" else {}
        record_injection(self.cwd, f.fault, f.rank, done + 1, pid=pid, duration_s=f.duration, **extra)
        if f.fault == "link_drop":
            link.down()
        else:
            link.loss(pct)
        try:
            return self._lasts(f.duration)
        finally:
            if f.fault == "link_drop":
                link.up()
            else:
                link.loss(0)

    def _slow_disk(self, f: Planned, done: int, pid: int) -> float | None:
        import psutil

        ck = self.cwd / self.cert.job.checkpoint_dir
        ck.mkdir(parents=True, exist_ok=True)
        bps = int((f.arg or 16) * 1024)
        cg, why = blkio_cgroup(ck, bps)
        if cg is None:
            self.skipped.append(f"slow_disk: {why}")
            return None
        try:
            proc = psutil.Process(pid)
            for p in [proc.pid, *(c.pid for c in proc.children(recursive=True))]:  # writer children too
                (cg / "cgroup.procs").write_text(str(p))
            record_injection(self.cwd, "slow_disk", f.rank, done + 1, pid=pid, duration_s=f.duration,
                             write_bps=bps)  # fmt: skip
            return self._lasts(f.duration)
        except psutil.NoSuchProcess:
            return None
        finally:
            release_blkio(cg)

    def _corrupt(self) -> None:
        """Flip 64 bytes in the middle of the newest committed checkpoint's first shard (two must be
        committed), kill the whole job with its shared memory, start it again: the restart must
        read the disk, reject that checkpoint and load the one before."""
        from resilient.checkpoint.manifest import committed_steps

        ck = self.cwd / self.cert.job.checkpoint_dir
        while time.monotonic() < self.deadline and self.job.p.poll() is None:
            if ck.exists() and len(committed_steps(ck)) >= 2:
                break
            time.sleep(0.05)
        else:
            return
        self.job.kill()
        newest = committed_steps(ck)[0]
        victim = sorted((ck / f"step-{newest:08d}").glob("rank*.bin"))[0]
        with open(victim, "r+b") as fh:
            fh.seek(os.path.getsize(victim) // 2)
            chunk = fh.read(64)
            fh.seek(-len(chunk), os.SEEK_CUR)
            fh.write(bytes(b ^ 0xFF for b in chunk))
        record_injection(self.cwd, "corrupt_checkpoint", -1, newest, file=victim.name)
        self.job = Job(self.cert, self.cwd, self.plan, attempt=self.attempt, link=self.link)
