"""Fault injectors keyed by (rank, step): each one a real fault, each counting what fired.

A plan is written ``kind@step[:rank][=arg][xN][/forwardM|/backwardM]``, comma-separated, e.g.
``exception@5:1,hang@9:0``. ``xN`` repeats the fault at that step N times (every time the step is
re-run after a restart, up to N); without it a fault fires once. ``/forwardM`` (``/backwardM``)
fires it inside the step, at the stage's microbatch M's forward (backward), chaos/points.py.
``kind`` is one of the in-process kinds of :data:`chaos.faults.REGISTRY` (``chaos kinds`` lists
them, and what each one does): the injector finds the kind there and lets it fire.
"""

from __future__ import annotations

import functools
import json
import os
import re
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from chaos.faults import REGISTRY, InjectedFault, Undo, Where
from chaos.points import Point
from resilient.events import read_events

KINDS = REGISTRY.names(lambda k: k.in_process)  # what a plan can name
_SPEC = re.compile(
    r"^(?P<kind>[a-z_0-9]+)@(?P<step>\d+)(?::(?P<rank>\d+))?(?:=(?P<arg>[\d.]+))?(?:x(?P<n>\d+))?"
    r"(?:/(?P<at>forward|backward)(?P<mb>\d+))?$"
)

__all__ = ["KINDS", "Fault", "InjectedFault", "Injector"]


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int = 0
    arg: float | None = None
    times: int = 1
    at: str = "step"  # or forward / backward: inside the step, at microbatch ``microbatch``
    microbatch: int = 0

    @property
    def where(self) -> Where:
        return REGISTRY[self.kind].where


@dataclass
class Injector:
    """Fires the faults of a plan when ``(rank, step, where)`` matches; counts what fired."""

    faults: list[Fault] = field(default_factory=list)
    fired: Counter[Fault] = field(default_factory=Counter)
    _undo: list[tuple[int, Undo]] = field(default_factory=list)  # (step, undo) of one-step changes

    @classmethod
    def parse(cls, plan: str | None) -> Injector:
        faults = []
        for part in filter(None, (p.strip() for p in (plan or "").split(","))):
            m = _SPEC.match(part)
            if not m or m["kind"] not in KINDS:
                raise ValueError(
                    f"bad fault spec {part!r}: expected kind@step[:rank][=arg][xN][/forwardM|/backwardM], "
                    f"kind in {KINDS}"
                )
            faults.append(
                Fault(
                    kind=m["kind"],
                    step=int(m["step"]),
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
        tracks (a ``desync`` acts on a DDP model among them)."""
        for s, undo in [u for u in self._undo if u[0] != step]:  # a one-step change (desync) ends
            undo()
            self._undo.remove((s, undo))
        objects = list(objects)
        for f in self.faults:
            if f.rank == rank and f.step == step and f.where == where and self.fired[f] < f.times:
                if f.at != "step":  # armed on the stage's module, fired inside the step
                    disarm = Point(f.at, f.microbatch).arm(
                        objects, functools.partial(self._fire, f, step, objects)
                    )
                    if disarm is not None:
                        self._undo.append((step, disarm))
                    continue
                self._fire(f, step, objects)

    def _fire(self, f: Fault, step: int, objects: Iterable[object]) -> None:
        if self.fired[f] >= f.times:
            return
        self.fired[f] += 1
        if _fired_in_job(f) >= f.times:  # an earlier process of this job fired it already
            return
        _record(f)
        until_next_step = REGISTRY[f.kind].inject(f, objects)
        if until_next_step is not None:
            self._undo.append((step, until_next_step))

    def counts(self) -> dict[str, int]:
        return {f"{f.kind}@{f.step}:{f.rank}": self.fired[f] for f in self.faults}


def _fired_in_job(f: Fault) -> int:
    """How often earlier processes of this job fired ``f`` (``$CHAOS_INJECTIONS``): a relaunched
    worker must not fire a planned fault again (a fault per plan entry, not per process)."""
    path = os.environ.get("CHAOS_INJECTIONS")  # chaos.hooks.Var.INJECTIONS
    if not path:
        return 0
    return sum(
        r.get("by") == "injector" and (r["kind"], r["step"], r["rank"]) == (f.kind, f.step, f.rank)
        for r in read_events(path)
    )


def _record(f: Fault) -> None:
    """Append what is about to fire, and when, to ``$CHAOS_INJECTIONS`` (the certificate's t0)."""
    path = os.environ.get("CHAOS_INJECTIONS")
    if not path:
        return
    # (fsync: the next thing may be a hang, an OOM-kill or a GIL-bound loop)
    append_line(path, {"ts": time.time(), "kind": f.kind, "rank": f.rank, "step": f.step, "pid": os.getpid(),
                       "by": "injector"}, fsync=True)  # fmt: skip


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
