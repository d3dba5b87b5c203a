"""The metrics' model of one run: what one refresh computes from the event log (the run's state,
steps per rank, checkpoints, restart budgets, wall time by cause), served by the exporter and
printed by ``resilient status``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from resilient.events import Event
from resilient.metrics.accounting import Accounting, account


@dataclass
class Model:
    """What one refresh computed from the log."""

    accounting: Accounting | None = None
    run_id: str = ""
    state: str = "starting"  # starting | running | recovering | finished | failed
    generation: int = 0
    steps: dict[int, tuple[int, float]] = field(default_factory=dict)  # rank -> (step, ts)
    step_s: dict[int, float] = field(default_factory=dict)
    runtime_s_per_step: dict[int, float] = field(default_factory=dict)
    checkpoints: dict[str, int] = field(default_factory=dict)  # saved / failed / rejected
    block_s: list[float] = field(default_factory=list)
    durable_s: list[float] = field(default_factory=list)
    checkpoint_bytes: int = 0
    # scope -> what is left: in_process (recoveries), launcher (group restarts), replacements
    budget: dict[str, float] = field(default_factory=dict)
    info: dict[str, str] = field(default_factory=dict)  # engine, backend, world size
    # (rank, host) -> (straggler_detected reports, the last one's slowdown)
    stragglers: dict[tuple[int, str], tuple[int, float]] = field(default_factory=dict)
    standbys: dict[int, str] = field(default_factory=dict)  # pid -> warmth of the standbys that wait
    standby_fallbacks: int = 0  # standbys that could not park in the script


def build_model(events: list[dict[str, Any]], run_id: str, now: float | None = None) -> Model:
    m = Model(run_id=run_id)
    acc = account(events, now=now if not _ended(events) else None)
    m.accounting = acc
    started: dict[str, Any] = {}  # the last run_started: the in-process budget's limits
    for e in events:
        if e.get("event") == Event.RUN_STARTED:
            started = e
        _fold(m, e)
    max_restarts = started.get("max_recoveries", started.get("max_restarts"))  # (logs before the rename)
    if max_restarts is not None:
        window = started.get("restart_window_s")
        recent = [
            i
            for i in acc.incidents
            if i.mode == "in_process" and (window is None or acc.end - i.start <= window)
        ]
        m.budget["in_process"] = float(max(0, int(max_restarts) - len(recent)))
    m.state = _state(events, acc, m.steps)
    return m


def _fold(m: Model, e: dict[str, Any]) -> None:
    """One record of the log into ``m``."""
    ev, r = e.get("event"), e.get("rank", -1)
    ranked = isinstance(r, int) and r >= 0
    if ranked:
        m.generation = max(m.generation, int(e.get("generation") or 0))
    if ev in (Event.PROGRESS, Event.STEP_COMPLETED, Event.STEP_RESUMED) and ranked:
        _fold_step(m, e)
    elif ev in (Event.CHECKPOINT_SAVED, Event.CHECKPOINT_DURABLE, Event.CHECKPOINT_FAILED):
        _fold_checkpoint(m, e)
    elif ev == Event.CHECKPOINT_REJECTED:
        m.checkpoints["rejected"] = m.checkpoints.get("rejected", 0) + 1
    elif ev == Event.RUN_STARTED:
        m.info = {k: str(e.get(k)) for k in ("engine", "backend", "world_size")}
    elif ev == Event.STRAGGLER_DETECTED and isinstance(r, int):
        n, _ = m.stragglers.get((r, str(e.get("host") or "")), (0, 0.0))
        m.stragglers[(r, str(e.get("host") or ""))] = (n + 1, float(e.get("slowdown") or 0.0))
    elif ev == Event.STANDBY_READY and e.get("standby_pid") is not None:
        m.standbys[int(e["standby_pid"])] = str(e.get("warmth") or "imported")
    elif ev == Event.STANDBY_FALLBACK:
        m.standby_fallbacks += 1
    if ev == Event.RANK_REPLACED and e.get("standby"):
        m.standbys.pop(int(e.get("new_pid") or -1), None)
    if ev in (Event.WORKERS_STARTED, Event.RANK_REPLACED) and e.get("restarts_left") is not None:
        m.budget["launcher"] = float(e["restarts_left"])
    if ev in (Event.WORKERS_STARTED, Event.RANK_REPLACED) and e.get("replacements_left") is not None:
        m.budget["replacements"] = float(e["replacements_left"])


def _fold_step(m: Model, e: dict[str, Any]) -> None:
    """A rank's step record: its newest step, and the step time it carries."""
    ev, r = e["event"], e["rank"]
    if isinstance(e.get("step"), int):
        m.steps[r] = (e["step"], e["ts"])
    if ev == Event.PROGRESS:
        if e.get("step_s") is not None:
            m.step_s[r] = float(e["step_s"])
        if e.get("runtime_ms_per_step") is not None:
            m.runtime_s_per_step[r] = float(e["runtime_ms_per_step"]) / 1e3
    elif ev == Event.STEP_COMPLETED and e.get("step_s") is not None:
        m.step_s[r] = float(e["step_s"])


def _fold_checkpoint(m: Model, e: dict[str, Any]) -> None:
    """A save's record: saved (not the final one at a preemption), written, or failed."""
    ev = e["event"]
    if ev == Event.CHECKPOINT_SAVED and not e.get("final"):
        m.checkpoints["saved"] = m.checkpoints.get("saved", 0) + 1
        if e.get("block_s") is not None:
            m.block_s.append(float(e["block_s"]))
    elif ev == Event.CHECKPOINT_DURABLE:
        m.durable_s.append(float(e.get("write_s") or 0.0))
        m.checkpoint_bytes = int(e.get("nbytes") or 0)
    elif ev == Event.CHECKPOINT_FAILED:
        m.checkpoints["failed"] = m.checkpoints.get("failed", 0) + 1


def _state(events: list[dict[str, Any]], acc: Accounting, steps: dict[int, tuple[int, float]]) -> str:
    """The run's state: failed (a rank gave up, and no step since), finished, recovering, running,
    or still starting."""
    failed_at = max((e["ts"] for e in events if e.get("event") == Event.RUN_FAILED), default=None)
    stepped_at = max((ts for _s, ts in steps.values()), default=0.0)
    if failed_at is not None and failed_at >= stepped_at:
        return "failed"
    if _ended(events):
        return "finished"
    if acc.incidents and acc.incidents[-1].end is None:
        return "recovering"
    return "running" if steps else "starting"


def _ended(events: list[dict[str, Any]]) -> bool:
    return any(e.get("event") in (Event.RUN_FINISHED, Event.RUN_PREEMPTED) for e in events)
