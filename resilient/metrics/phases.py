"""The phases of an in-process recovery, timed from the event log: where each millisecond went.

Every rank records the end of each phase (``fault_detected``'s ``noticed_ts``, ``group_aborted``,
``health_checked``, ``restore_agreed``, ``group_rebuilt``, ``state_restored``, its first step
after the restore), and the events carry the parts that a single record does not end
(``restore_agreed.prepare_s``: materializing the agreed snapshot; ``group_rebuilt.build_s``: the
group built after the failed generation was freed; ``state_restored.load_s``: the snapshot loaded
into the objects as the function tracked them again). A phase ends, for the job, when its *last*
rank ended it: the phases are the differences between those instants, so they add up to the
recovery (the fault to every rank stepping again), and a rank that is late in one phase (a slow
health check) is charged there, not in the barrier where its peers waited for it.

The same records carry the main thread's CPU time (``cpu_s``, and the parts' ``*_cpu_s``): each
phase's CPU time on each rank, the costliest rank's kept (:attr:`Phases.cpu`). Wall time is what
a fault costs; CPU time is what the runtime's own work costs, whatever else the machine runs
(a rank descheduled for 100 ms by a busy neighbour shows in the first, not in the second), which
makes it the regression guard of a loaded machine (the certificate's ``phase_cpu_p50_s``).

================  ================================================================================
``detect``        the fault happened, until every rank knew (its own exception, or its listener)
``leave``         out of the step: interrupted, the fault posted, the group aborted
``health``        the health checks
``agree``         the newest snapshot every rank holds agreed (with DDP's layouts, in one barrier);
                  also a save still in flight finished, the policy's backoff, the snapshots verified
``free``          the failed generation's objects freed (the collection before the new group)
``rebuild``       the next generation's process group built
``restore``       the agreed snapshot materialized, and loaded into the objects as they are tracked
``reenter``       the training function, from the top up to its first step, less those loads
``rerun``         the first step after the restore, to its end
================  ================================================================================
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from resilient.events import Event

if TYPE_CHECKING:
    from resilient.metrics.accounting import Incident

PHASES = ("detect", "leave", "health", "agree", "free", "rebuild", "restore", "reenter", "rerun")

# each rank's instants, in the order they happen on it: mark -> the record it is read from (by its
# name in a rank's records), and the part that lies between the mark and that record's end (None:
# it is the record's end); the one table for both clocks, the wall's ``ts`` and the CPU's ``cpu_s``
_MARKS: dict[str, tuple[str, str | None]] = {
    "noticed": (Event.FAULT_DETECTED, None),
    "left": (Event.GROUP_ABORTED, None),
    "checked": (Event.HEALTH_CHECKED, None),
    "agreed": (Event.RESTORE_AGREED, "prepare"),
    "prepared": (Event.RESTORE_AGREED, None),
    "freed": (Event.GROUP_REBUILT, "build"),
    "rebuilt": (Event.GROUP_REBUILT, None),
    "entered": (Event.STATE_RESTORED, "load"),
    "restored": (Event.STATE_RESTORED, None),
    "resumed": ("step", None),
}
# phase -> the (from, to) mark pairs it is made of
_SPANS: dict[str, tuple[tuple[str, str], ...]] = {
    "leave": (("noticed", "left"),),
    "health": (("left", "checked"),),
    "agree": (("checked", "agreed"),),
    "free": (("prepared", "freed"),),
    "rebuild": (("freed", "rebuilt"),),
    "restore": (("agreed", "prepared"), ("entered", "restored")),
    "reenter": (("rebuilt", "entered"),),
    "rerun": (("restored", "resumed"),),
}


@dataclass
class Phases:
    """One recovery's phases (seconds; None where a rank's record of it is missing), the rank that
    ended each last (the one the others waited for), and the agreement's parts on that rank."""

    generation: int
    start: float
    seconds: dict[str, float | None] = field(default_factory=dict)
    ranks: dict[str, int | None] = field(default_factory=dict)
    agree_parts: dict[str, float] = field(default_factory=dict)
    total: float | None = None
    cpu: dict[str, float | None] = field(default_factory=dict)  # the costliest rank's CPU s per phase

    def complete(self) -> bool:
        return all(self.seconds.get(p) is not None for p in PHASES)


def _num(e: dict[str, Any] | None, key: str) -> float | None:
    v = e.get(key) if e is not None else None
    return float(v) if isinstance(v, int | float) else None


def _read_marks(own: dict[str, dict[str, Any]], clock: str, suffix: str) -> dict[str, float | None]:
    """One rank's instants on one clock (``own``: record name -> record): a record's reading of the
    clock (its field ``clock``), less the part :data:`_MARKS` names (its field ``<part><suffix>``)."""
    out: dict[str, float | None] = {}
    for mark, (name, before) in _MARKS.items():
        e = own.get(name)
        at, d = _num(e, clock), (_num(e, before + suffix) if before is not None else None)
        out[mark] = None if at is None else at - (d or 0.0)
    return out


def _marks(own: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """One rank's instants from its records of the recovery (``own``: record name -> record)."""
    out = _read_marks(own, "ts", "_s")
    noticed = _num(own.get(Event.FAULT_DETECTED), "noticed_ts")
    if noticed is not None:  # (else a log from before noticed_ts: the record's own ts)
        out["noticed"] = noticed
    return out


def _cpu_marks(own: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """One rank's main-thread CPU clock at the same instants as :func:`_marks` (None where a
    record predates the stamps)."""
    # (of the step records only step_resumed carries the CPU stamp)
    return _read_marks({**own, "step": own.get(Event.STEP_RESUMED, {})}, "cpu_s", "_cpu_s")


def _span_cpu(m: dict[str, float | None], spans: tuple[tuple[str, str], ...]) -> float | None:
    total = 0.0
    for a, b in spans:
        lo, hi = m[a], m[b]
        if lo is None or hi is None:
            return None
        total += hi - lo
    return max(0.0, total)


def _phase_cpu(per: dict[int, dict[str, dict[str, Any]]]) -> dict[str, float | None]:
    """Each phase's CPU time on the rank where it cost most (None where a rank lacks a stamp)."""
    marks = [_cpu_marks(own) for own in per.values()]
    out: dict[str, float | None] = dict.fromkeys(PHASES)
    for phase, spans in _SPANS.items():
        costs = [_span_cpu(m, spans) for m in marks]
        known = [c for c in costs if c is not None]
        if known and len(known) == len(costs):
            out[phase] = max(known)
    return out


def recovery_phases(events: Iterable[dict[str, Any]], generation: int, start: float) -> Phases:
    """The phases of the recovery from ``generation`` (its fault happened at ``start``), from the
    records of every rank that detected it."""
    evs = [e for e in events if isinstance(e.get("rank"), int) and e["rank"] >= 0 and "ts" in e]
    evs.sort(key=lambda e: e["ts"])
    out = Phases(generation, start, dict.fromkeys(PHASES), dict.fromkeys(PHASES))
    per: dict[int, dict[str, dict[str, Any]]] = {}
    for e in evs:
        ev, g, r = e.get("event"), e.get("generation"), e["rank"]
        leaving = (Event.FAULT_DETECTED, Event.GROUP_ABORTED, Event.HEALTH_CHECKED, Event.RESTORE_AGREED)
        if ev in leaving and g == generation:
            if ev == Event.FAULT_DETECTED or r in per:
                per.setdefault(r, {}).setdefault(ev, e)
        elif g == generation + 1 and r in per:
            name = "step" if ev in (Event.STEP_COMPLETED, Event.STEP_RESUMED) else ev
            if name in (Event.GROUP_REBUILT, Event.STATE_RESTORED, "step"):
                per[r].setdefault(name, e)
            if ev == Event.STEP_RESUMED:  # (the one with the CPU stamp: step_completed has none)
                per[r].setdefault(ev, e)
    if not per:
        return out
    marks = {r: _marks(own) for r, own in per.items()}
    last: dict[str, tuple[float, int]] = {}  # mark -> (when the last rank reached it, that rank)
    for m in _MARKS:
        got = [(ts, r) for r, v in marks.items() if (ts := v[m]) is not None]
        if len(got) == len(marks):  # (a rank without the record: that mark, and its phases, unknown)
            last[m] = max(got)
    # every rank's instants are in order, so the last ones are too: no phase is negative
    if "noticed" in last:
        out.seconds["detect"], out.ranks["detect"] = max(0.0, last["noticed"][0] - start), last["noticed"][1]
    for phase, spans in _SPANS.items():
        if all(a in last and b in last for a, b in spans):
            out.seconds[phase] = sum(max(0.0, last[b][0] - last[a][0]) for a, b in spans)
            out.ranks[phase] = last[spans[-1][1]][1]
    if "prepared" in last:
        rec = per[last["prepared"][1]].get(Event.RESTORE_AGREED, {})
        out.agree_parts = {
            k: float(v)
            for k, v in rec.items()
            if k.endswith("_s") and k != "duration_s" and isinstance(v, int | float)
        }
    if "resumed" in last:
        out.total = max(0.0, last["resumed"][0] - start)
    out.cpu = _phase_cpu(per)
    return out


def incident_phases(records: list[dict[str, Any]], start: float) -> Phases | None:
    """The phases of an in-process recovery whose records (``Incident.records``) begin with the
    fault's first detection; None for one that was not in-process (no ``restore_agreed``)."""
    first = next(
        (e for e in records if e.get("event") == Event.FAULT_DETECTED and e.get("rank", -1) >= 0), None
    )
    if first is None or not any(e.get("event") == Event.RESTORE_AGREED for e in records):
        return None
    return recovery_phases(records, int(first["generation"]), start)


def fault_start(records: list[dict[str, Any]]) -> float | None:
    """When the fault of an incident's records happened, on its origin's clock: the first
    detection's ``origin_ts`` (else its own ts), less ``origin_latency_s`` (a hang's idle time, as
    the accounting's ``Incident.start``); None without a rank's ``fault_detected``."""
    first = next(
        (e for e in records if e.get("event") == Event.FAULT_DETECTED and e.get("rank", -1) >= 0), None
    )
    if first is None:
        return None
    return float(first.get("origin_ts") or first["ts"]) - float(first.get("origin_latency_s") or 0.0)


def of_incident(inc: Incident) -> Phases | None:
    """The phases of one of the accounting's incidents, timed from when its fault happened; None
    unless it was recovered in-process (``resilient events --faults``, the exporter's histogram)."""
    start = fault_start(inc.records)
    return None if inc.mode != "in_process" or start is None else incident_phases(inc.records, start)


def fmt(p: Phases) -> str:
    """``detect 2.1, leave 0.8, ... ms (= 81.2 ms)``: one line for a person."""

    def ms(x: float | None) -> str:
        return "—" if x is None else f"{1e3 * x:.1f}"

    body = ", ".join(f"{name} {ms(p.seconds.get(name))}" for name in PHASES)
    return f"{body} ms" + ("" if p.total is None else f" (= {ms(p.total)} ms)")
