"""A lost node: every process of the rank's node — its ``resilient launch`` agent, its workers,
its standbys — SIGKILLed at once, and the node's ``/dev/shm`` (its snapshots, its heartbeats)
removed with them, as a machine that fails takes them. Needs a job of several nodes
(``job.nodes``); with ``job.spare`` the fault waits until the spare node parked, its standby
ready (what the class certifies is a spare taking the lost node's seat)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING

from chaos.faults.base import ByHarness

if TYPE_CHECKING:
    from chaos.runner import Runner
    from chaos.schedule import Planned


def parent(pid: int) -> int:
    """``pid``'s parent (its agent, for a worker torch started)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[1])


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                if parent(int(entry.name)) == pid:
                    out.append(int(entry.name))
    return out


class LoseNode(ByHarness):
    name = "lose_node"
    summary = "the rank's node lost: its agent, workers and standbys SIGKILLed, its /dev/shm removed"
    kills = True
    streams = False  # (a job of nodes; a stream's job is one node)

    def by_harness(self, run: Runner, f: Planned, done: int, pid: int) -> float | None:
        if run.cert.job.nodes < 2:
            run.skipped.append(f"{self.name}: the job is one node (job.nodes: 2 or more)")
            return None
        job = run.job
        while run.cert.job.spare and not job.spare_ready() and time.monotonic() < run.deadline:
            time.sleep(0.05)  # (polls the event log: the spare's agent says when it parked)
        agent = parent(pid)
        kin = children(agent)  # workers and standbys, each in a session of its own
        os.killpg(agent, signal.SIGKILL)
        for p in kin:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p, signal.SIGKILL)
        job.lost.add(agent)
        run.record(self.name, f.rank, done + 1, pid=pid, agent=agent, killed=len(kin) + 1)
        for leftover in Path("/dev/shm").glob(f"resilient-*-{agent}"):
            shutil.rmtree(leftover, ignore_errors=True)
        return None
