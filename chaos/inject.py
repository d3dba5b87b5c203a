"""Fault injectors keyed by (rank, step): each one a real fault, each counting what fired.

A plan is written ``kind@step[:rank][=arg][xN][/forwardM|/backwardM]``, comma-separated, e.g.
``exception@5:1,hang@9:0``. ``xN`` repeats the fault at that step N times (every time the step is
re-run after a restart, up to N); without it a fault fires once. ``/forwardM`` (``/backwardM``)
fires it inside the step, at the stage's microbatch M's forward (backward), chaos/points.py.

``kind@point[:rank]`` (a point of :data:`~resilient.runtime.hooks.POINTS` in place of the step:
``exception@restore:1``, ``sigkill@agree:0``) fires when the rank's recovery reaches that point
(the runtime's ``on_phase`` hook), once per job: the second fault of a compound class, a fault
inside the recovery from the first. The kinds that can: :data:`POINT_KINDS`.
``kind`` is one of the in-process kinds of :data:`chaos.faults.REGISTRY` (``chaos kinds`` lists
them, and what each one does): the injector finds the kind there and lets it fire.

What fired, and when, is appended to ``$CHAOS_INJECTIONS`` (the certificate's t0). A fault whose
change lasts its step may find nothing to act on there (a ``desync`` in a step that issues no
collective, a point inside the step that never comes): once the step is over the injector appends
that it did not act, and why; :func:`outcomes` reads the two apart, and the certificate skips such
a trial, naming the reason, instead of failing a detector that had nothing to detect.
"""

from __future__ import annotations

import functools
import json
import os
import re
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from chaos.faults import REGISTRY, InjectedFault, Undo, Where
from chaos.points import Point
from resilient.events import read_events
from resilient.runtime.hooks import POINTS

KINDS = REGISTRY.names(lambda k: k.in_process)  # what a plan can name
POINT_KINDS = REGISTRY.names(lambda k: k.in_recovery)  # what a plan can fire at a recovery's point
_SPEC = re.compile(
    r"^(?P<kind>[a-z_0-9]+)@(?:(?P<step>\d+)|(?P<during>[a-z_]+))(?::(?P<rank>\d+))?(?:=(?P<arg>[\d.]+))?"
    r"(?:x(?P<n>\d+))?(?:/(?P<at>forward|backward)(?P<mb>\d+))?$"
)

__all__ = ["KINDS", "Fault", "InjectedFault", "Injector", "NotActed", "outcomes"]
IDLE = "did_not_act"  # the key of an injections record that says a fault did not act, and why


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int = 0
    arg: float | None = None
    times: int = 1
    at: str = "step"  # or forward / backward: inside the step, at microbatch ``microbatch``
    microbatch: int = 0
    during: str | None = None  # a recovery's point (``step`` is then -1): fired there, not at a step

    @property
    def where(self) -> Where:
        return REGISTRY[self.kind].where


class _Change(NamedTuple):
    """A change that lasts its step: a fault's (``fired``), or the hooks of a point armed for one."""

    step: int
    fault: Fault
    undo: Undo
    fired: bool


@dataclass
class Injector:
    """Fires the faults of a plan when ``(rank, step, where)`` matches; counts what fired."""

    faults: list[Fault] = field(default_factory=list)
    fired: Counter[Fault] = field(default_factory=Counter)
    _changes: list[_Change] = field(default_factory=list)  # the one-step changes not yet undone

    @classmethod
    def parse(cls, plan: str | None) -> Injector:
        faults = []
        for part in filter(None, (p.strip() for p in (plan or "").split(","))):
            m = _SPEC.match(part)
            why = _bad_spec(m)
            if m is None or why is not None:
                raise ValueError(
                    f"bad fault spec {part!r}: expected kind@step[:rank][=arg][xN][/forwardM|/backwardM] "
                    f"or kind@point[:rank]: {why or 'not of that form'}"
                )
            faults.append(
                Fault(
                    kind=m["kind"],
                    step=int(m["step"]) if m["step"] else -1,
                    during=m["during"],
                    rank=int(m["rank"] or 0),
                    arg=float(m["arg"]) if m["arg"] else None,
                    times=int(m["n"] or 1),
                    at=m["at"] or "step",
                    microbatch=int(m["mb"] or 0),
                )
            )
        return cls(faults)

    def maybe_fire(self, rank: int, step: int, where: str = "step", objects: Iterable[object] = ()) -> None:
        """Fire the faults planned for ``(rank, step, where)``. ``objects``: the state the runtime
        tracks (a ``desync`` acts on a DDP model among them). A step's start ends the one-step
        changes made before it (a re-run of the same step's too); a later place, other steps'."""
        self._end(lambda s: where == "step" or s != step)
        objects = list(objects)
        for f in self.faults:
            if f.rank == rank and f.step == step and f.where == where and self.fired[f] < f.times:
                if f.at != "step":  # armed on the stage's module, fired inside the step
                    point = Point(f.at, f.microbatch)
                    disarm = point.arm(objects, functools.partial(self._fire, f, step, objects))
                    if disarm is None:
                        _record_idle(f, f"no tracked torch.nn.Module to arm its point ({point}) on", False)
                    else:
                        self._changes.append(_Change(step, f, disarm, fired=False))
                    continue
                self._fire(f, step, objects)

    def at_point(self, rank: int, point: str) -> None:
        """Fire the faults planned for ``rank`` at the recovery point ``point``."""
        for f in self.faults:
            if f.during == point and f.rank == rank and self.fired[f] < f.times:
                self.fired[f] += 1
                if _fired_in_job(f) >= f.times:
                    continue
                _record(f)
                REGISTRY[f.kind].at_point(f)

    def step_over(self) -> None:
        """The step is over (it completed, or the run did): its one-step changes end, and a fault
        that did not act in it is recorded with why."""
        self._end(lambda s: True)

    def _end(self, which: Callable[[int], bool]) -> None:
        for change in [c for c in self._changes if which(c.step)]:
            self._changes.remove(change)
            why = change.undo()
            if why is not None:
                _record_idle(change.fault, why, change.fired)

    def _fire(self, f: Fault, step: int, objects: Iterable[object]) -> None:
        if self.fired[f] >= f.times:
            return
        self.fired[f] += 1
        if _fired_in_job(f) >= f.times:  # an earlier process of this job fired it already
            return
        _record(f)
        until_step_over = REGISTRY[f.kind].inject(f, objects)
        if until_step_over is not None:
            self._changes.append(_Change(step, f, until_step_over, fired=True))

    def counts(self) -> dict[str, int]:
        return {f"{f.kind}@{f.during or f.step}:{f.rank}": self.fired[f] for f in self.faults}


def _bad_spec(m: re.Match[str] | None) -> str | None:
    """Why a matched plan entry names what cannot be (None: it can)."""
    if m is None:
        return None
    if m["during"] is None:
        return None if m["kind"] in KINDS else f"kind not in {KINDS}"
    if m["during"] not in POINTS:
        return f"point {m['during']!r} not in {POINTS}"
    if m["at"] or m["arg"]:
        return "a fault at a recovery's point takes no =arg or /point"
    return None if m["kind"] in POINT_KINDS else f"at a point, kind in {POINT_KINDS}"


def _fired_in_job(f: Fault) -> int:
    """How often earlier processes of this job fired ``f`` (``$CHAOS_INJECTIONS``): a relaunched
    worker must not fire a planned fault again (a fault per plan entry, not per process)."""
    path = os.environ.get("CHAOS_INJECTIONS")  # chaos.hooks.Var.INJECTIONS
    if not path:
        return 0
    planned = (f.kind, _step(f), f.rank, f.during)
    return sum(
        r.get("by") == "injector"
        and IDLE not in r
        and (r["kind"], r["step"], r["rank"], r.get("during")) == planned
        for r in read_events(path)
    )


def _step(f: Fault) -> int | None:
    """The step a record names: None for a fault at a recovery's point."""
    return None if f.during else f.step


def _record(f: Fault) -> None:
    """Append what is about to fire, and when, to ``$CHAOS_INJECTIONS`` (the certificate's t0)."""
    path = os.environ.get("CHAOS_INJECTIONS")
    if not path:
        return
    # (fsync: the next thing may be a hang, an OOM-kill or a GIL-bound loop)
    append_line(
        path,
        {
            "ts": time.time(),
            "kind": f.kind,
            "rank": f.rank,
            "step": _step(f),
            "pid": os.getpid(),
            "by": "injector",
            **({"during": f.during} if f.during else {}),
        },
        fsync=True,
    )


def _record_idle(f: Fault, why: str, fired: bool) -> None:
    """Append to ``$CHAOS_INJECTIONS`` that ``f`` did not act, and why (``fired``: it fired, and
    found nothing to act on; else the point it was armed for never came)."""
    path = os.environ.get("CHAOS_INJECTIONS")
    if not path:
        return
    append_line(
        path,
        {
            "ts": time.time(),
            "kind": f.kind,
            "rank": f.rank,
            "step": f.step,
            "pid": os.getpid(),
            "by": "injector",
            IDLE: why,
            "fired": fired,
        },
    )


@dataclass(frozen=True)
class NotActed:
    """A planned fault that did not act where it was planned, and why."""

    kind: str
    step: int
    rank: int
    why: str

    def __str__(self) -> str:
        return f"{self.kind}@{self.step}:{self.rank} did not act: {self.why}"


def outcomes(records: Iterable[Mapping[str, Any]]) -> tuple[list[dict[str, Any]], list[NotActed]]:
    """A job's injections record (in the order it was written) read apart: the records of the
    faults that acted (the harness's, and each of the injector's firings that no did-not-act
    record of the same fault in the same process follows) and the faults that did not act."""
    acted: list[dict[str, Any]] = []
    idle: list[NotActed] = []
    for r in records:
        if IDLE not in r:
            acted.append(dict(r))
            continue
        idle.append(NotActed(r["kind"], r["step"], r["rank"], r[IDLE]))
        if r.get("fired"):  # (its firing, the last one of the same fault and process, did not act)
            same = (r["kind"], r["step"], r["rank"], r.get("pid"))
            at = [
                i
                for i, a in enumerate(acted)
                if a.get("by") == "injector" and (a["kind"], a["step"], a["rank"], a.get("pid")) == same
            ]
            if at:
                del acted[at[-1]]
    return acted, idle


def append_line(path: str | os.PathLike[str], record: dict[str, object], fsync: bool = False) -> None:
    """Append ``record`` as one JSON line in one write: lines of different ranks never interleave
    (the injections file, an example's ``--progress`` file)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
