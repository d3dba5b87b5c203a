"""The Prometheus metric families of one model of the log (the part of a scrape that changes only
when the model does): the run's state, its faults and recoveries, stragglers, wall time by cause,
checkpoints and restart budgets. ``run`` is every series' own labels (the run, the Slurm job)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from resilient.metrics.accounting import CAUSES, OTHER, Accounting, Incident
from resilient.metrics.model import Model
from resilient.metrics.phases import PHASES, of_incident

DETECT_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
RECOVER_BUCKETS = (0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
PHASE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BLOCK_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0)
DURABLE_BUCKETS = (0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0)
_MODES = ("in_process", "replacement", "relaunch")  # how a fault was recovered


def families(m: Model, run: dict[str, str]) -> Iterator[Any]:
    """Every family of the model ``m``, in the order a scrape lists them."""
    from prometheus_client.core import InfoMetricFamily

    incidents = m.accounting.incidents if m.accounting is not None else []
    yield from _run(m, run)
    yield _faults(incidents, run)
    if m.info:
        info = InfoMetricFamily("resilient_run", "the run's engine, backend and world size", labels=list(run))
        info.add_metric(list(run.values()), m.info)
        yield info
    yield from _recoveries(incidents, run)
    yield from _stragglers(m, run)
    rerun = sum(i.steps_rerun or 0 for i in incidents)
    yield counter("resilient_steps_rerun", "steps done again after restores", run, rerun)
    yield from _time(m.accounting, run)
    if incidents:
        yield from _last_fault(incidents[-1], run)
    yield from _checkpoints(m, run)
    for scope, left in sorted(m.budget.items()):
        yield gauge(
            "resilient_restart_budget_remaining",
            "recoveries, group restarts or replacements left (by scope) before the run gives up",
            {**run, "scope": scope},
            left,
        )


def _run(m: Model, run: dict[str, str]) -> Iterator[Any]:
    """The run's state and generation, and the standbys that wait to replace a rank."""
    from prometheus_client.core import GaugeMetricFamily

    ids = list(run.values())
    state = GaugeMetricFamily("resilient_run_state", "1 for the run's current state", labels=[*run, "state"])
    for s in ("starting", "running", "recovering", "finished", "failed"):
        state.add_metric([*ids, s], float(m.state == s))
    yield state
    yield gauge(
        "resilient_generation", "the newest generation (in-process restarts so far)", run, m.generation
    )
    ready = GaugeMetricFamily(
        "resilient_standbys_ready",
        "standbys that wait to take a dead rank's place, by warmth (parked in the script, or imported)",
        labels=[*run, "warmth"],
    )
    for w in ("parked", "imported"):
        ready.add_metric([*ids, w], float(sum(v == w for v in m.standbys.values())))
    yield ready
    yield counter(
        "resilient_standby_fallbacks",
        "standbys that could not park in the script (standby_fallback)",
        run,
        m.standby_fallbacks,
    )


def _faults(incidents: Sequence[Incident], run: dict[str, str]) -> Any:
    from prometheus_client.core import CounterMetricFamily

    faults = CounterMetricFamily(
        "resilient_faults",
        "faults (incidents) by kind, rank and host",
        labels=[*run, "kind", "rank", "host"],
    )
    by: dict[tuple[str, str, str], int] = {}
    for i in incidents:
        k = (i.kind, str(i.rank), i.host or "")
        by[k] = by.get(k, 0) + 1
    for (kind, rank, host), n in sorted(by.items()):
        faults.add_metric([*run.values(), kind, rank, host], n)
    return faults


def _recoveries(incidents: Sequence[Incident], run: dict[str, str]) -> Iterator[Any]:
    """How the faults were recovered, and how long detection, recovery and its phases took."""
    from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

    ids = list(run.values())
    restarts = CounterMetricFamily(
        "resilient_restarts",
        "recovered faults by how: in_process, replacement (one rank), relaunch (the group)",
        labels=[*run, "mode"],
    )
    for mode in _MODES:
        restarts.add_metric([*ids, mode], sum(i.mode == mode and i.end is not None for i in incidents))
    yield restarts
    yield histogram(
        "resilient_detection_seconds",
        "fault to first noticed",
        run,
        [i.detect_s for i in incidents],
        DETECT_BUCKETS,
    )
    rec = HistogramMetricFamily(
        "resilient_recovery_seconds", "noticed to every rank stepping again", labels=[*run, "mode"]
    )
    for mode in _MODES:
        vals = [i.recover_s for i in incidents if i.mode == mode and i.recover_s is not None]
        rec.add_metric([*ids, mode], *buckets(vals, RECOVER_BUCKETS))
    yield rec
    # the in-process recoveries' phases (docs/recovery.md#phases): each ended one, once
    phased = [p for i in incidents if i.end is not None and (p := of_incident(i)) is not None]
    ph = HistogramMetricFamily(
        "resilient_recovery_phase_seconds",
        "an in-process recovery's phases (each until its last rank ended it), adding up to the recovery",
        labels=[*run, "phase"],
    )
    for name in PHASES:
        vals = [v for p in phased if (v := p.seconds.get(name)) is not None]
        ph.add_metric([*ids, name], *buckets(vals, PHASE_BUCKETS))
    yield ph


def _stragglers(m: Model, run: dict[str, str]) -> Iterator[Any]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    stragglers = CounterMetricFamily(
        "resilient_stragglers",
        "straggler_detected reports: a rank whose own work per step was slower than its peers'",
        labels=[*run, "rank", "host"],
    )
    slowdown = GaugeMetricFamily(
        "resilient_straggler_slowdown",
        "the last reported straggler's work per step / the median of its peers'",
        labels=[*run, "rank", "host"],
    )
    for (slow, where), (n, factor) in sorted(m.stragglers.items()):
        stragglers.add_metric([*run.values(), str(slow), where], n)
        slowdown.add_metric([*run.values(), str(slow), where], factor)
    yield stragglers
    yield slowdown


def _time(acc: Accounting | None, run: dict[str, str]) -> Iterator[Any]:
    """Wall time by cause, and the goodput."""
    from prometheus_client.core import GaugeMetricFamily

    # a gauge: time is re-attributed as the log tells more (a hang's silence becomes detection)
    t = GaugeMetricFamily(
        "resilient_time_seconds",
        "wall time so far by cause (goodput accounting)",
        labels=[*run, "cause"],
    )
    for c in (*CAUSES, OTHER):
        t.add_metric([*run.values(), c], acc.seconds[c] if acc is not None else 0.0)
    yield t
    if acc is not None and acc.goodput is not None:
        yield gauge("resilient_goodput_ratio", "productive step time / wall time", run, acc.goodput)


def _last_fault(last: Incident, run: dict[str, str]) -> Iterator[Any]:
    from prometheus_client.core import InfoMetricFamily

    info = InfoMetricFamily("resilient_last_fault", "the newest fault", labels=list(run))
    info.add_metric(
        list(run.values()),
        {
            "kind": last.kind,
            "rank": str(last.rank),
            "host": str(last.host or ""),
            "step": str(last.step),
            "noticed_by": last.noticed_by,
            "mode": last.mode,
            "signature": last.signature[:200],
        },
    )
    yield info
    yield gauge("resilient_last_fault_timestamp_seconds", "when the newest fault happened", run, last.start)


def _checkpoints(m: Model, run: dict[str, str]) -> Iterator[Any]:
    """Checkpoint saves by outcome, how long a step waited for one, and how long one took."""
    from prometheus_client.core import CounterMetricFamily

    ck = CounterMetricFamily(
        "resilient_checkpoints", "checkpoint saves by outcome (per rank)", labels=[*run, "outcome"]
    )
    for o in ("saved", "failed", "rejected"):
        ck.add_metric([*run.values(), o], m.checkpoints.get(o, 0))
    yield ck
    yield histogram(
        "resilient_checkpoint_blocking_seconds",
        "time a step waited for a checkpoint save",
        run,
        m.block_s,
        BLOCK_BUCKETS,
    )
    yield histogram(
        "resilient_checkpoint_durable_seconds",
        "a rank's part of a checkpoint: save started to written",
        run,
        m.durable_s,
        DURABLE_BUCKETS,
    )
    yield gauge(
        "resilient_checkpoint_bytes", "tensor bytes of a rank's last checkpoint", run, m.checkpoint_bytes
    )


def gauge(name: str, doc: str, labels: dict[str, str], value: float) -> Any:
    from prometheus_client.core import GaugeMetricFamily

    f = GaugeMetricFamily(name, doc, labels=list(labels))
    f.add_metric(list(labels.values()), value)
    return f


def counter(name: str, doc: str, labels: dict[str, str], value: float) -> Any:
    from prometheus_client.core import CounterMetricFamily

    f = CounterMetricFamily(name, doc, labels=list(labels))
    f.add_metric(list(labels.values()), value)
    return f


def buckets(values: list[float], bounds: tuple[float, ...]) -> tuple[list[tuple[str, float]], float]:
    """A histogram's cumulative buckets of ``values`` at ``bounds``, and their sum."""
    out = [(repr(float(b)), float(sum(v <= b for v in values))) for b in bounds]
    out.append(("+Inf", float(len(values))))
    return out, float(sum(values))


def histogram(
    name: str, doc: str, labels: dict[str, str], values: list[float], bounds: tuple[float, ...]
) -> Any:
    from prometheus_client.core import HistogramMetricFamily

    f = HistogramMetricFamily(name, doc, labels=list(labels))
    f.add_metric(list(labels.values()), *buckets(values, bounds))
    return f
