"""Goodput accounting by cause, from a run's event log alone.

Every second of a run's wall time (its first launch to its last record) is given to exactly one
cause, the highest in this order among those that claim it:

====================  ==========================================================================
``detection``         a fault happened, no one has noticed yet (a hang's timeout, a heartbeat's)
``relaunch``          noticed; the whole group is restarted and has not stepped again yet
``replacement``       noticed; one dead rank is replaced, until every rank has stepped again
``recovery``          noticed; recovered in-process, until every rank has stepped again
``startup``           the first launch, until every rank has completed its first step
``checkpoint``        a step blocked in a checkpoint save (its copy)
``rollback``          a step the guard or the replica digests rejected (a NaN, a spike, a replica
                      that diverged): the recovery, and the steps done again after it
``rerun``             a step done again after a restore, and the part of a step a fault threw away
``productive``        a step completed for the first time
``other``             nothing above (after the last step, until the processes report their end;
                      a preempted job's time away, until its requeued run steps again)
====================  ==========================================================================

Steps are exact with ``events.steps: true`` (one record per rank per step); otherwise they come
from the ``progress`` records (every ``events.progress_s``) and the fault records, and a stretch
between two of them is split between re-run and new steps in proportion to their counts.

A *fault* here is an incident: the first signal (a rank's ``fault_detected``, the agent's
``worker_died`` or ``heartbeat_missed``) opens it, and it lasts until every rank has completed a
step in a new generation or process. Later signals before that (peers noticing the same death, a
double fault) belong to it. A preemption is no fault: its ranks' ``fault_detected`` (kind
``preempt``) and the agent's ``worker_died`` for their exit 76 open nothing; ``run_preempted``
records it.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from resilient.detectors import REGISTRY as DETECTORS
from resilient.errors import ExitCode
from resilient.events import Event

CAUSES = (
    "detection",
    "relaunch",
    "replacement",
    "recovery",
    "startup",
    "checkpoint",
    "rollback",
    "rerun",
    "productive",
)  # by priority: a moment claimed by several causes is the first's
OTHER = "other"
MODE_CAUSE = {
    "relaunch": "relaunch",
    "replacement": "replacement",
    "in_process": "recovery",
    "failed": "recovery",
}
_STEPPING = {Event.STEP_COMPLETED, Event.PROGRESS, Event.STEP_RESUMED}
_SIGNALS = {Event.FAULT_DETECTED, Event.WORKER_DIED, Event.HEARTBEAT_MISSED}
# faults that crash nothing: a step whose update would have been wrong, rolled back and replayed
# (a detector's fault says so itself: ``rolls_back``)
ROLLBACK_KINDS = DETECTORS.symptoms(lambda f: f.rolls_back)


@dataclass
class Incident:
    """One fault, from its first signal until every rank stepped again (``end``; None: never)."""

    start: float  # when it happened: the origin's clock (a hang: its last progress)
    detected: float  # when someone first noticed
    end: float | None
    kind: str
    rank: int | None  # the rank it happened to
    step: int | None
    host: str | None
    pid: int | None
    noticed_by: str  # "rank N" or "agent"
    signature: str
    mode: str = "in_process"  # in_process | replacement | relaunch | failed
    agent_cause: bool = False  # the cause is the agent's record of a dead or silent worker
    steps_rerun: int | None = None
    source: str | None = None  # where the restored state came from: live | ring | shm (state_restored)
    work_lost_s: float | None = None  # the restored step's start to the fault: the work thrown away
    records: list[dict[str, Any]] = field(default_factory=list)
    slurm: dict[str, Any] | None = None  # under Slurm: the job, step and node it happened on (as ``host``)

    @property
    def detect_s(self) -> float:
        return max(0.0, self.detected - self.start)

    @property
    def recover_s(self) -> float | None:
        return None if self.end is None else max(0.0, self.end - self.detected)


@dataclass
class Accounting:
    start: float
    end: float
    seconds: dict[str, float]  # by cause, ``other`` included; they add up to ``wall_s``
    incidents: list[Incident]
    steps: int  # the highest step any rank completed, plus one
    segments: list[tuple[float, float, str]]  # the timeline: (from, to, cause), in order
    exact_steps: bool  # True: from step_completed records; False: from progress records

    @property
    def wall_s(self) -> float:
        return self.end - self.start

    @property
    def goodput(self) -> float | None:
        return self.seconds["productive"] / self.wall_s if self.wall_s > 0 else None

    def table(self) -> list[tuple[str, float, float]]:
        """(cause, seconds, share of wall time), every cause in priority order, ``other`` last."""
        wall = self.wall_s or 1.0
        return [(c, self.seconds[c], self.seconds[c] / wall) for c in (*CAUSES, OTHER)]


def preemption(e: dict[str, Any]) -> bool:
    """A record of a preemption, not of a fault: a rank's (kind ``preempt``), or its exit with 76
    (the final checkpoint committed) as its agent saw it."""
    if e["event"] == Event.FAULT_DETECTED:
        return e.get("kind") == "preempt"
    return e["event"] == Event.WORKER_DIED and e.get("exitcode") == int(ExitCode.REQUEUE)


def _signal(e: dict[str, Any]) -> tuple[float, float, str, int | None, int | None, str, str, int | None]:
    """(origin ts, noticed ts, kind, rank, step, noticed by, signature, pid) of a fault signal."""
    ts = float(e["ts"])
    if e["event"] == Event.FAULT_DETECTED:
        # (a hang is posted when its timeout expires: it began origin_latency_s before)
        origin = float(e.get("origin_ts") or ts) - float(e.get("origin_latency_s") or 0.0)
        return (
            min(origin, ts),
            ts,
            str(e.get("kind")),
            e.get("origin_rank"),
            e.get("origin_step"),
            f"rank {e['rank']}",
            str(e.get("signature") or e.get("kind")),
            None,
        )
    if e["event"] == Event.HEARTBEAT_MISSED:
        silent = float(e.get("silent_s") or 0.0)
        return (
            ts - silent,
            ts,
            "no_heartbeat",
            e.get("global_rank"),
            e.get("last_step"),
            "agent",
            f"no heartbeat for {silent:.1f} s",
            e.get("pid"),
        )
    cause = str(e.get("cause") or "died")
    kind = "kernel_oom" if "OOM-killed" in cause else "killed" if "killed by" in cause else "exited"
    return ts, ts, kind, e.get("global_rank"), None, "agent", cause, e.get("pid")


def account(events: Iterable[dict[str, Any]], now: float | None = None) -> Accounting:
    """Account ``events`` (one run, any order); ``now``: the end of a run still going."""
    evs = sorted((e for e in events if isinstance(e.get("ts"), int | float)), key=lambda e: e["ts"])
    if not evs:
        t = now or 0.0
        return Accounting(t, t, dict.fromkeys((*CAUSES, OTHER), 0.0), [], 0, [], False)
    starts = [e["ts"] for e in evs if e["event"] in (Event.WORKERS_STARTED, Event.RUN_STARTED)]
    # the job starts when its launcher did: its imports and rendezvous are startup too
    starts += [float(e["launched"]) for e in evs if e["event"] == Event.WORKERS_STARTED and e.get("launched")]
    t0 = min(starts) if starts else evs[0]["ts"]
    t1 = max(now or 0.0, evs[-1]["ts"])
    exact = any(e["event"] == Event.STEP_COMPLETED for e in evs)
    world = max((int(e.get("world_size") or 0) for e in evs if e["event"] == Event.RUN_STARTED), default=0)
    incidents = _incidents(evs, world)
    claims: list[tuple[float, float, str]] = []
    for inc in incidents:
        claims.append((inc.start, inc.detected, "detection"))
        cause = (
            "rollback" if inc.kind in ROLLBACK_KINDS and inc.mode == "in_process" else MODE_CAUSE[inc.mode]
        )
        claims.append((inc.detected, inc.end if inc.end is not None else t1, cause))
    first = _first_steps(evs, world)
    if first is not None:
        claims.append((t0, first, "startup"))
    for e in evs:
        if e["event"] == Event.CHECKPOINT_SAVED and e.get("block_s"):
            claims.append((e["ts"] - float(e["block_s"]), e["ts"], "checkpoint"))
    top = 0
    claims += _steps(evs, incidents, exact)
    for e in evs:
        stepped = e["event"] in _STEPPING or e["event"] == Event.RUN_FINISHED
        if stepped and isinstance(e.get("step"), int) and e.get("rank", -1) >= 0:
            top = max(top, e["step"] + 1)
    seconds, segments = _paint(claims, t0, t1)
    return Accounting(t0, t1, seconds, incidents, top, segments, exact)


def _incidents(evs: Sequence[dict[str, Any]], world: int) -> list[Incident]:
    """The run's faults in order: each opened by its first signal, ended when every rank it waits
    on has stepped in a new process or generation."""
    out: list[Incident] = []
    key: dict[int, tuple[Any, Any]] = {}  # rank -> (pid, generation) of its latest step record
    open_: Incident | None = None
    waiting: dict[int, tuple[Any, Any] | None] = {}  # rank -> the key it must leave to count as resumed
    for e in evs:
        ev, rank = e["event"], e.get("rank", -1)
        if ev in _SIGNALS and preemption(e):
            continue
        if open_ is not None:
            open_.records.append(e)
            _learn(open_, e)
        if ev in _STEPPING and isinstance(rank, int) and rank >= 0:
            k = (e.get("pid"), e.get("generation"))
            if open_ is not None and rank in waiting and waiting[rank] != k and e["ts"] > open_.detected:
                del waiting[rank]
                if not waiting:
                    open_.end = e["ts"]
                    out.append(open_)
                    open_ = None
            key[rank] = k
        elif ev in _SIGNALS and open_ is None:
            open_ = _opened(e)
            waiting = {r: key.get(r) for r in set(key) | set(range(world))}
        elif ev in _SIGNALS and open_ is not None:
            _signalled_again(open_, e)
        elif ev == Event.RUN_FAILED and open_ is not None:
            open_.mode = "failed"
    if open_ is not None:
        if open_.mode != "failed" and any(r["event"] == Event.RUN_FAILED for r in open_.records):
            open_.mode = "failed"
        out.append(open_)
    return out


def _learn(inc: Incident, e: dict[str, Any]) -> None:
    """What a record during an open incident tells of it: how it is recovered (a rank replaced,
    the group relaunched), the steps re-run, where the restored state came from."""
    ev = e["event"]
    if ev == Event.RANK_REPLACED and inc.mode == "in_process":
        inc.mode = "replacement"
    elif ev in (Event.RELAUNCHED, Event.GROUP_STOPPED):
        inc.mode = "relaunch"
    elif ev == Event.STATE_RESTORED and e.get("steps_rerun") is not None:
        inc.steps_rerun = max(inc.steps_rerun or 0, int(e["steps_rerun"]))
        inc.source = inc.source or e.get("source")
        if e.get("work_lost_s") is not None:
            inc.work_lost_s = max(inc.work_lost_s or 0.0, float(e["work_lost_s"]))
    elif ev == Event.STATE_RESTORED and inc.step is not None and isinstance(e.get("step"), int):
        inc.steps_rerun = max(inc.steps_rerun or 0, inc.step - e["step"])
    elif ev == Event.RANK_REPLACED and inc.step is None:
        inc.step = e.get("last_step")


def _opened(e: dict[str, Any]) -> Incident:
    """The incident a fault's first signal opens."""
    origin, noticed, kind, frank, fstep, by, sig, pid = _signal(e)
    own = e["event"] != Event.FAULT_DETECTED or e.get("rank") == e.get("origin_rank")
    return Incident(
        start=origin,
        detected=noticed,
        end=None,
        kind=kind,
        rank=frank,
        step=fstep,
        host=e.get("host") if own else None,
        slurm=e.get("slurm") if own else None,
        pid=pid if not own or pid is not None else e.get("pid"),
        noticed_by=by,
        signature=sig,
        records=[e],
        agent_cause=e["event"] != Event.FAULT_DETECTED,
    )


def _signalled_again(inc: Incident, e: dict[str, Any]) -> None:
    """A later signal of an open incident: an earlier origin, the origin's own record, or the
    agent's record of the worker whose death its peers saw."""
    origin, noticed, kind, frank, fstep, _by, sig, pid = _signal(e)
    inc.start, inc.detected = min(inc.start, origin), min(inc.detected, noticed)
    if e["event"] == Event.FAULT_DETECTED and inc.host is None and e.get("rank", -1) == inc.rank:
        inc.host, inc.pid = e.get("host"), e.get("pid")  # the origin's own record
        inc.slurm = e.get("slurm")
    if e["event"] != Event.FAULT_DETECTED and not inc.agent_cause:
        # a dead or silent worker explains what its peers saw (a broken collective)
        inc.kind, inc.rank, inc.signature, inc.pid = kind, frank, sig, pid
        inc.host, inc.slurm = e.get("host"), e.get("slurm")
        inc.step = fstep if fstep is not None else inc.step
        inc.agent_cause = True


def _first_steps(evs: Sequence[dict[str, Any]], world: int) -> float | None:
    """When every rank of the first launch had completed a step."""
    seen: dict[int, float] = {}
    for e in evs:
        r = e.get("rank", -1)
        if e["event"] in _STEPPING and isinstance(r, int) and r >= 0 and r not in seen:
            seen[r] = e["ts"]
            if len(seen) >= max(1, world):
                return max(seen.values())
    return max(seen.values()) if seen else None


def _done_before(inc: Incident, rank: int, restored: Sequence[dict[str, Any]]) -> int:
    """The last step ``rank`` completed before ``inc``: the step before the fault's, or, for a
    fault known by no step (a dead process), the step before the one its restore re-ran from
    (sparse progress records lag far behind it)."""
    if inc.step is not None:
        return int(inc.step) - 1
    after = (e for e in restored if e["ts"] >= inc.start and e.get("rank") == rank)
    e = next(after, None)
    return -1 if e is None else int(e["step"]) + int(e.get("steps_rerun") or 0) - 1


def _steps(
    evs: Sequence[dict[str, Any]], incidents: Sequence[Incident], exact: bool
) -> list[tuple[float, float, str]]:
    """Each rank's stretches between two step samples, as productive or re-run."""
    samples: dict[int, list[tuple[float, float, Any]]] = {}  # rank -> (ts, completed step, process key)
    kinds = {Event.STEP_COMPLETED} if exact else {Event.PROGRESS, Event.STEP_RESUMED}
    for e in evs:
        r = e.get("rank", -1)
        if (e["event"] in kinds and isinstance(r, int) and r >= 0 and isinstance(e.get("step"), int)) or (
            not exact
            and e["event"] == Event.RUN_FINISHED
            and isinstance(r, int)
            and r >= 0
            and isinstance(e.get("step"), int)
        ):
            samples.setdefault(r, []).append((e["ts"], e["step"], (e.get("pid"), e.get("generation"))))
    restored = [e for e in evs if e["event"] == Event.STATE_RESTORED and isinstance(e.get("step"), int)]
    for rank, ss in samples.items():  # the step a fault interrupted: up to the fault, the work is lost
        cut = []
        for inc in incidents:
            before = [s for s in ss if s[0] <= inc.start]
            if before:
                last = before[-1]
                at = max(last[1], _done_before(inc, rank, restored))
                cut.append((inc.start, at, last[2]))
        ss += cut
    claims: list[tuple[float, float, str]] = []
    starts = sorted((inc.start, inc.kind in ROLLBACK_KINDS) for inc in incidents)

    def rerun(at: float) -> str:
        """A step done again at ``at``: the roll-back's, when the last fault before it was one."""
        i = bisect.bisect_right(starts, (at, True)) - 1
        return "rollback" if i >= 0 and starts[i][1] else "rerun"

    for ss in samples.values():
        ss.sort(key=lambda s: s[0])
        done = -1.0
        for (ta, sa, ka), (tb, sb, kb) in itertools.pairwise(ss):
            if ka != kb:  # a new process or generation: its first step belongs to the recovery
                done = max(done, sa)
                continue
            n = sb - sa
            new = max(0.0, sb - max(done, sa))
            if n <= 0 or new <= 0:
                claims.append((ta, tb, rerun(tb)))
            elif new >= n:
                claims.append((ta, tb, "productive"))
            else:  # the re-run steps come first
                split = ta + (tb - ta) * (n - new) / n
                claims += [(ta, split, rerun(split)), (split, tb, "productive")]
            done = max(done, sb)
    return claims


def _paint(
    claims: list[tuple[float, float, str]], t0: float, t1: float
) -> tuple[dict[str, float], list[tuple[float, float, str]]]:
    """Give each moment of [t0, t1] to the highest-priority claim on it (a sweep over boundaries)."""
    prio = {c: i for i, c in enumerate(CAUSES)}
    bounds: list[tuple[float, int, int]] = []
    for a, b, c in claims:
        a, b = max(a, t0), min(b, t1)
        if b > a:
            bounds += [(a, 1, prio[c]), (b, -1, prio[c])]
    bounds.sort()
    active = [0] * len(CAUSES)
    heap: list[int] = []
    seconds = dict.fromkeys((*CAUSES, OTHER), 0.0)
    segments: list[tuple[float, float, str]] = []
    t = t0
    i = 0
    while i <= len(bounds):
        nxt = bounds[i][0] if i < len(bounds) else t1
        while heap and active[heap[0]] == 0:
            heapq.heappop(heap)
        cause = CAUSES[heap[0]] if heap else OTHER
        if nxt > t:
            seconds[cause] += nxt - t
            if segments and segments[-1][2] == cause and segments[-1][1] == t:
                segments[-1] = (segments[-1][0], nxt, cause)
            else:
                segments.append((t, nxt, cause))
            t = nxt
        if i == len(bounds):
            break
        _, d, p = bounds[i]
        active[p] += d
        if d > 0:
            heapq.heappush(heap, p)
        i += 1
    return seconds, segments
