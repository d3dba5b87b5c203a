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
from resilient.metrics.families import counter, families
from resilient.metrics.model import Model, build_model

__all__ = ["Exporter", "LogTail", "Model", "RunMetrics", "build_model"]


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
        yield counter(
            "resilient_exporter_cpu_seconds", "CPU time of this endpoint's own work", self.labels, self.cpu_s
        )

    def _collect(self) -> Iterator[Any]:
        with self._lock:
            m = self.model
        cached = self._families
        if cached is None or cached[0] is not m:  # the log's part changes only when the model does
            cached = self._families = (m, list(families(m, self.labels)))
        yield from cached[1]
        yield from self._live(m)

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
