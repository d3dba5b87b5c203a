"""Prometheus metrics of one run, served over HTTP by the launcher's agent (``--metrics-port``) or,
under plain torchrun, by local rank 0 (``metrics.port`` in the config).

The metrics are computed from the run's event log and the workers' heartbeat files, the same
sources ``resilient events``, ``resilient report`` and the certificate read: a counter here is a
count of records there, so what Prometheus shows can be checked against the log. A thread tails
the log (reading only what was appended) and recomputes the model at most every ``refresh_s``;
a scrape serves the last model plus the heartbeats read at that moment. The training processes do
nothing for it under the launcher: the agent reads what they already write.

Nothing here may stop training: a taken port, a log that cannot be read, an error while a scrape
is answered — each is one warning, and the run goes on without (that part of) its metrics.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from loguru import logger

from resilient.contract import read_beats
from resilient.events import LogTail
from resilient.metrics.accounting import CAUSES, OTHER
from resilient.metrics.model import Model, build_model
from resilient.metrics.phases import PHASES, of_incident

__all__ = ["Exporter", "LogTail", "Model", "RunMetrics", "build_model"]

DETECT_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
RECOVER_BUCKETS = (0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
PHASE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BLOCK_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0)
DURABLE_BUCKETS = (0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0)


class RunMetrics:
    """Everything the endpoint serves for one run: the log's model and the live heartbeats."""

    def __init__(
        self,
        log: Path,
        *,
        run_id: str,
        heartbeat_dir: Path | None = None,
        global_ranks: Callable[[], dict[int, int]] | None = None,
        refresh_s: float = 5.0,
        labels: Mapping[str, str] | None = None,
    ) -> None:
        self.tail = LogTail(log)
        self.run_id = run_id
        # every series' own labels: the run, and where the launcher knows it, the Slurm job
        self.labels = {"run_id": run_id, **(labels or {})}
        self._ids = list(self.labels.values())
        self.heartbeat_dir = heartbeat_dir
        self.global_ranks = global_ranks  # local rank -> global rank, from the agent
        self.refresh_s = refresh_s
        self.events: list[dict[str, Any]] = []
        self.model = Model(run_id=run_id)
        self._lock = threading.Lock()
        self._dirty = False
        self._computed = 0.0
        self._warned: set[str] = set()
        self._families: tuple[Model, list[Any]] | None = None  # (the model, its metric families)
        self.cpu_s = 0.0  # CPU time the exporter's own work took (reading, recomputing, scrapes)

    def warn_once(self, what: str, msg: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning(f"metrics: {msg}; training is not affected")

    def poll(self, force: bool = False) -> None:
        """Read what the log gained; recompute when it changed and ``refresh_s`` passed (or ``force``)."""
        t0 = time.thread_time()
        try:
            self._poll(force)
        finally:
            self.cpu_s += time.thread_time() - t0

    def _poll(self, force: bool) -> None:
        new = self.tail.poll()
        self.events += new
        self._dirty |= bool(new)
        now = time.monotonic()
        if self._dirty and (force or now - self._computed >= self.refresh_s):
            model = build_model(self.events, self.run_id, now=time.time())
            with self._lock:
                self.model = model
            self._dirty, self._computed = False, now

    def heartbeats(self) -> dict[int, tuple[float, int, int]]:
        """local rank -> (age s, step, generation) of each worker's last beat."""
        if self.heartbeat_dir is None:
            return {}
        return {r: (b.age_s, b.step, b.generation) for r, b in read_beats(self.heartbeat_dir).items()}

    # -- a scrape -----------------------------------------------------------------------------
    def collect(self) -> Iterator[Any]:
        t0 = time.thread_time()
        try:
            yield from self._collect()
        except Exception as e:  # a scrape mid-restart must not take the exporter down
            self.warn_once("collect", f"a scrape failed ({type(e).__name__}: {e})")
        self.cpu_s += time.thread_time() - t0
        yield _counter(
            "resilient_exporter_cpu_seconds", "CPU time of this endpoint's own work", self.labels, self.cpu_s
        )

    def _collect(self) -> Iterator[Any]:
        with self._lock:
            m = self.model
        cached = self._families
        if cached is None or cached[0] is not m:  # the log's part changes only when the model does
            cached = self._families = (m, list(self._from_model(m)))
        yield from cached[1]
        yield from self._live(m)

    def _from_model(self, m: Model) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
            InfoMetricFamily,
        )

        acc = m.accounting
        run = self.labels
        labels = list(run)
        state = GaugeMetricFamily(
            "resilient_run_state", "1 for the run's current state", labels=[*labels, "state"]
        )
        for s in ("starting", "running", "recovering", "finished", "failed"):
            state.add_metric([*self._ids, s], float(m.state == s))
        yield state
        yield _gauge(
            "resilient_generation", "the newest generation (in-process restarts so far)", run, m.generation
        )
        ready = GaugeMetricFamily(
            "resilient_standbys_ready",
            "standbys that wait to take a dead rank's place, by warmth (parked in the script, or imported)",
            labels=[*labels, "warmth"],
        )
        for w in ("parked", "imported"):
            ready.add_metric([*self._ids, w], float(sum(v == w for v in m.standbys.values())))
        yield ready
        yield _counter(
            "resilient_standby_fallbacks",
            "standbys that could not park in the script (standby_fallback)",
            run,
            m.standby_fallbacks,
        )
        incidents = acc.incidents if acc is not None else []
        faults = CounterMetricFamily(
            "resilient_faults",
            "faults (incidents) by kind, rank and host",
            labels=[*labels, "kind", "rank", "host"],
        )
        by: dict[tuple[str, str, str], int] = {}
        for i in incidents:
            k = (i.kind, str(i.rank), i.host or "")
            by[k] = by.get(k, 0) + 1
        for (kind, rank, host), n in sorted(by.items()):
            faults.add_metric([*self._ids, kind, rank, host], n)
        yield faults
        if m.info:
            info = InfoMetricFamily(
                "resilient_run", "the run's engine, backend and world size", labels=labels
            )
            info.add_metric(self._ids, m.info)
            yield info
        restarts = CounterMetricFamily(
            "resilient_restarts",
            "recovered faults by how: in_process, replacement (one rank), relaunch (the group)",
            labels=[*labels, "mode"],
        )
        for mode in ("in_process", "replacement", "relaunch"):
            restarts.add_metric(
                [*self._ids, mode], sum(i.mode == mode and i.end is not None for i in incidents)
            )
        yield restarts
        yield _histogram(
            HistogramMetricFamily,
            "resilient_detection_seconds",
            "fault to first noticed",
            run,
            [i.detect_s for i in incidents],
            DETECT_BUCKETS,
        )
        rec = HistogramMetricFamily(
            "resilient_recovery_seconds", "noticed to every rank stepping again", labels=[*labels, "mode"]
        )
        for mode in ("in_process", "replacement", "relaunch"):
            vals = [i.recover_s for i in incidents if i.mode == mode and i.recover_s is not None]
            buckets, total = _buckets(vals, RECOVER_BUCKETS)
            rec.add_metric([*self._ids, mode], buckets, total)
        yield rec
        # the in-process recoveries' phases (docs/recovery.md#phases): each ended one, once
        phased = [p for i in incidents if i.end is not None and (p := of_incident(i)) is not None]
        ph = HistogramMetricFamily(
            "resilient_recovery_phase_seconds",
            "an in-process recovery's phases (each until its last rank ended it), adding up to the recovery",
            labels=[*labels, "phase"],
        )
        for name in PHASES:
            vals = [v for p in phased if (v := p.seconds.get(name)) is not None]
            buckets, total = _buckets(vals, PHASE_BUCKETS)
            ph.add_metric([*self._ids, name], buckets, total)
        yield ph
        stragglers = CounterMetricFamily(
            "resilient_stragglers",
            "straggler_detected reports: a rank whose own work per step was slower than its peers'",
            labels=[*labels, "rank", "host"],
        )
        slowdown = GaugeMetricFamily(
            "resilient_straggler_slowdown",
            "the last reported straggler's work per step / the median of its peers'",
            labels=[*labels, "rank", "host"],
        )
        for (slow, where), (n, factor) in sorted(m.stragglers.items()):
            stragglers.add_metric([*self._ids, str(slow), where], n)
            slowdown.add_metric([*self._ids, str(slow), where], factor)
        yield stragglers
        yield slowdown
        rerun = sum(i.steps_rerun or 0 for i in incidents)
        yield _counter("resilient_steps_rerun", "steps done again after restores", run, rerun)
        # a gauge: time is re-attributed as the log tells more (a hang's silence becomes detection)
        t = GaugeMetricFamily(
            "resilient_time_seconds",
            "wall time so far by cause (goodput accounting)",
            labels=[*labels, "cause"],
        )
        for c in (*CAUSES, OTHER):
            t.add_metric([*self._ids, c], acc.seconds[c] if acc is not None else 0.0)
        yield t
        if acc is not None and acc.goodput is not None:
            yield _gauge("resilient_goodput_ratio", "productive step time / wall time", run, acc.goodput)
        if incidents:
            last = incidents[-1]
            info = InfoMetricFamily("resilient_last_fault", "the newest fault", labels=labels)
            info.add_metric(
                self._ids,
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
            yield _gauge(
                "resilient_last_fault_timestamp_seconds", "when the newest fault happened", run, last.start
            )
        ck = CounterMetricFamily(
            "resilient_checkpoints", "checkpoint saves by outcome (per rank)", labels=[*labels, "outcome"]
        )
        for o in ("saved", "failed", "rejected"):
            ck.add_metric([*self._ids, o], m.checkpoints.get(o, 0))
        yield ck
        yield _histogram(
            HistogramMetricFamily,
            "resilient_checkpoint_blocking_seconds",
            "time a step waited for a checkpoint save",
            run,
            m.block_s,
            BLOCK_BUCKETS,
        )
        yield _histogram(
            HistogramMetricFamily,
            "resilient_checkpoint_durable_seconds",
            "a rank's part of a checkpoint: save started to written",
            run,
            m.durable_s,
            DURABLE_BUCKETS,
        )
        yield _gauge(
            "resilient_checkpoint_bytes", "tensor bytes of a rank's last checkpoint", run, m.checkpoint_bytes
        )
        for scope, left in sorted(m.budget.items()):
            yield _gauge(
                "resilient_restart_budget_remaining",
                "recoveries, group restarts or replacements left (by scope) before the run gives up",
                {**run, "scope": scope},
                left,
            )

    def _per_rank(self, name: str, doc: str, values: dict[int, float]) -> Any:
        from prometheus_client.core import GaugeMetricFamily

        f = GaugeMetricFamily(name, doc, labels=[*self.labels, "rank"])
        for r, v in sorted(values.items()):
            f.add_metric([*self._ids, str(r)], v)
        return f

    def _live(self, m: Model) -> Iterator[Any]:
        """What changes between two reads of the log: the heartbeats, and steps they carry."""
        from prometheus_client.core import GaugeMetricFamily

        labels = list(self.labels)
        step = GaugeMetricFamily("resilient_step", "the newest completed step", labels=[*labels, "rank"])
        step_ts = GaugeMetricFamily(
            "resilient_last_step_timestamp_seconds",
            "when a rank last reported progress",
            labels=[*labels, "rank"],
        )
        steps = dict(m.steps)
        beats = self.heartbeats()
        g = self.global_ranks() if self.global_ranks is not None else {}
        now = time.time()
        for local, (age, beat_step, _gen) in beats.items():
            r = g.get(local, local)
            if r not in steps or beat_step >= steps[r][0]:
                steps[r] = (beat_step, now - age)
        for r, (n, ts) in sorted(steps.items()):
            step.add_metric([*self._ids, str(r)], n)
            step_ts.add_metric([*self._ids, str(r)], ts)
        yield step
        yield step_ts
        yield self._per_rank("resilient_step_seconds", "recent step time", m.step_s)
        yield self._per_rank(
            "resilient_runtime_seconds_per_step",
            "the runtime's own time per step (snapshots, checks)",
            m.runtime_s_per_step,
        )
        hb = GaugeMetricFamily(
            "resilient_heartbeat_age_seconds",
            "since a worker's last heartbeat",
            labels=[*labels, "rank", "local_rank"],
        )
        for local, (age, _s, _gen) in sorted(beats.items()):
            hb.add_metric([*self._ids, str(g.get(local, local)), str(local)], age)
        yield hb


def _gauge(name: str, doc: str, labels: dict[str, str], value: float) -> Any:
    from prometheus_client.core import GaugeMetricFamily

    f = GaugeMetricFamily(name, doc, labels=list(labels))
    f.add_metric(list(labels.values()), value)
    return f


def _counter(name: str, doc: str, labels: dict[str, str], value: float) -> Any:
    from prometheus_client.core import CounterMetricFamily

    f = CounterMetricFamily(name, doc, labels=list(labels))
    f.add_metric(list(labels.values()), value)
    return f


def _buckets(values: list[float], bounds: tuple[float, ...]) -> tuple[list[tuple[str, float]], float]:
    out = [(repr(float(b)), float(sum(v <= b for v in values))) for b in bounds]
    out.append(("+Inf", float(len(values))))
    return out, float(sum(values))


def _histogram(
    cls: Any, name: str, doc: str, labels: dict[str, str], values: list[float], bounds: tuple[float, ...]
) -> Any:
    f = cls(name, doc, labels=list(labels))
    b, s = _buckets(values, bounds)
    f.add_metric(list(labels.values()), b, s)
    return f


class Exporter:
    """Serves :class:`RunMetrics` on ``addr:port`` and keeps it fed from a thread."""

    def __init__(self, metrics: RunMetrics, port: int, addr: str = "0.0.0.0", poll_s: float = 1.0) -> None:
        self.metrics, self.port, self.addr, self.poll_s = metrics, port, addr, poll_s
        self._stop = threading.Event()
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def start(self) -> bool:
        """Serve; False (and one warning) where the endpoint cannot be had. Training goes on."""
        try:
            from prometheus_client import CollectorRegistry, start_http_server
        except ImportError:
            self.metrics.warn_once(
                "import",
                "prometheus_client is not installed (pip install 'resilient[metrics]'): no metrics endpoint",
            )
            return False
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self.metrics)
        try:
            served = start_http_server(self.port, addr=self.addr, registry=registry)
        except OSError as e:
            self.metrics.warn_once(
                "port",
                f"cannot serve on {self.addr}:{self.port} ({e.strerror or e}): "
                "no metrics endpoint for this run",
            )
            return False
        self._server = served[0] if isinstance(served, tuple) else None
        if self._server is not None:
            self.port = self._server.server_address[1]  # (port 0: the one the kernel chose)
        self._thread = threading.Thread(target=self._run, name="resilient-metrics", daemon=True)
        self._thread.start()
        logger.info(f"metrics on http://{self.addr}:{self.port}/metrics")
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.metrics.poll()
            except Exception as e:  # the log unreadable, a torn record: say so once, keep serving
                self.metrics.warn_once(
                    "poll", f"reading {self.metrics.tail.path} failed ({type(e).__name__}: {e})"
                )

    def close(self, linger_s: float = 0.0) -> None:
        """Stop; with ``linger_s``, serve the final figures that long first (the last scrape)."""
        if self._thread is None:
            return
        with contextlib.suppress(Exception):
            self.metrics.poll(force=True)
        if linger_s > 0:
            time.sleep(linger_s)
        self._stop.set()
        self._thread.join(timeout=5)
        if self._server is not None:
            with contextlib.suppress(Exception):
                self._server.shutdown()
                self._server.server_close()
        self._thread = None
