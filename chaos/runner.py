"""The harness's side of a job: it watches the event log and, when the target rank reached a
fault's step, lets the fault's kind act on the rank's process (:meth:`FaultKind.by_harness`:
a signal, a memory cgroup, a throttled disk, a cut link, a corrupted checkpoint). Used by ``chaos
certify`` (one fault per job) and by ``chaos run`` / ``chaos stream`` (many), always through
:func:`chaos.arranged.arranged_job`.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chaos.faults import REGISTRY, Arrangement
from chaos.job import Job, record_injection
from chaos.schedule import Certification, Planned
from resilient.events import Event, EventTail


class Tail:
    """The job's event logs, read incrementally (a soak's log grows to ~10^5 lines: reading all of
    it on every poll would make the harness late for the faults it places)."""

    def __init__(self, cwd: Path) -> None:
        self.cwd = cwd
        self._tail = EventTail(cwd / "resilient_runs")
        self.reached: dict[int, tuple[int, int]] = {}  # rank → (newest step completed, its pid)
        self.standbys: dict[int, str] = {}  # pid → warmth of the launcher's standbys that wait

    def poll(self) -> None:
        for e in self._tail.poll():
            if e["event"] == Event.STEP_COMPLETED:
                self.reached[e["rank"]] = (e["step"], e["pid"])
            elif e["event"] == Event.RUN_STARTED and e["rank"] >= 0:  # a new process: from its start
                self.reached[e["rank"]] = (-1, e["pid"])
            elif e["event"] == Event.STANDBY_READY:
                self.standbys[e["standby_pid"]] = e.get("warmth", "imported")
            elif e["event"] == Event.RANK_REPLACED and e.get("standby"):
                self.standbys.pop(e["new_pid"], None)


def standby_at(evs: list[dict[str, Any]], ts: float) -> str:
    """The standby that waited at ``ts`` by the agents' events (``parked`` first, else
    ``imported``; ``none``): for a fault the rank fired on itself, which the harness did not see."""
    waiting: dict[int, str] = {}
    for e in sorted(evs, key=lambda e: e["ts"]):
        if e["ts"] > ts:
            break
        if e["event"] == Event.STANDBY_READY:
            waiting[e["standby_pid"]] = e.get("warmth", "imported")
        elif e["event"] == Event.RANK_REPLACED and e.get("standby"):
            waiting.pop(e["new_pid"], None)
    kinds = sorted(waiting.values(), key=lambda w: w != "parked")
    return kinds[0] if kinds else "none"


@dataclass
class Runner:
    """One job and the harness's faults on it; ``job`` is replaced when a fault restarts it."""

    cert: Certification
    cwd: Path
    plan: str  # the in-process faults (chaos/inject.py), fired by the runtime
    deadline: float
    arrangement: Arrangement = field(default_factory=lambda: Arrangement(ExitStack()))
    attempt: str | None = None  # "0": in-process faults only in the first launch attempt
    skipped: list[str] = field(default_factory=list)  # "kind: why" of faults that could not fire
    job: Job = field(init=False)
    tail: Tail = field(init=False)

    def __post_init__(self) -> None:
        self.restart()
        self.tail = Tail(self.cwd)

    def restart(self) -> None:
        """Start the job (again, on the same directory)."""
        self.job = Job(self.cert, self.cwd, self.plan, attempt=self.attempt, link=self.arrangement.link)

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
        """Do the harness's part of ``f`` when its rank reaches ``step`` (nothing for a fault that
        fires in-process only). Returns when a fault with a duration ended (the link back, the
        disk unthrottled), else None."""
        kind = REGISTRY[f.fault]
        if kind.harness_lead is None:
            return None
        hit = self.wait_rank(f.rank, step - kind.harness_lead)
        if hit is None:
            return None
        done, pid = hit
        try:
            return kind.by_harness(self, f, done, pid)
        except (ProcessLookupError, OSError):
            return None  # gone already (another fault's relaunch): not injected, not counted

    def record(self, kind: str, rank: int, step: int, **extra: Any) -> float:
        """Append to the job's ``injections.jsonl`` what the harness did, and when, with the
        standby that waited then (``parked``/``imported``; ``none``: none was ready)."""
        self.tail.poll()
        waiting = sorted(self.tail.standbys.values(), key=lambda w: w != "parked")
        standby = waiting[0] if waiting else "none"
        return record_injection(self.cwd, kind, rank, step, standby=standby, **extra)

    def lasts(self, seconds: float) -> float:
        """Wait while a fault lasts (or until the job ends); the time it ended."""
        with contextlib.suppress(subprocess.TimeoutExpired):  # the fault lasts this long by definition
            self.job.p.wait(seconds)
        return time.time()
