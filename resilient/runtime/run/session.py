"""The run in this process: who this rank is, what the wiring connected it to, and what the run
reports about itself — the part both engines share, outliving every generation.

A :class:`Session` is built from a :class:`~resilient.runtime.run.wiring.Wiring` (the store, the run
id agreed with the peers, the event log, the group builder, the launcher's heartbeat) with no
side effects; :meth:`Session.open` then starts the heartbeat and writes ``run_started``;
:meth:`Session.close` releases what the wiring brought, the event log last. In between, the
engines record through it what every engine records alike: a fault's detection and its report,
the health checks and their verdict.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from loguru import logger

from resilient.contract import mark_unhealthy, run_namespace
from resilient.detectors.collectives import issued_on_default_group
from resilient.errors import HealthCheckFailed
from resilient.events import Event, EventLog
from resilient.health import HealthInput, run_checks
from resilient.launch_env import Var
from resilient.native import names
from resilient.runtime.coordination.agreement import all_hold
from resilient.runtime.faults.records import FaultRecord
from resilient.runtime.faults.stacks import main_thread_where
from resilient.runtime.hooks import RunInfo
from resilient.runtime.run.schedule import SnapshotSchedule
from resilient.runtime.run.wiring import Setup, Wiring


class Session:
    """See the module docstring. ``generation``: the generation being run or recovered from, the
    one counter both engines advance (a :class:`~resilient.runtime.run.generation.Generation` is
    what one of them holds)."""

    def __init__(
        self, setup: Setup, wiring: Wiring, *, engine: str, namespace: str = "", ring_share: float = 1.0
    ) -> None:
        cfg, launch = setup.cfg, setup.launch
        ep = launch.endpoint
        self.cfg = cfg
        self.t = cfg.timeouts
        self.launch = launch
        self.rank, self.world_size, self.local_rank = ep.rank, ep.world_size, ep.local_rank
        self.engine = engine
        self.backend = setup.backend
        self.device = setup.device
        self.hooks = list(setup.hooks)
        self.checks = setup.checks
        self.detectors = setup.detectors
        self.wiring = wiring
        self.store = wiring.store
        self.clock = wiring.clock
        self.run_id = wiring.run_id
        self.events: EventLog = wiring.events
        self.heartbeat = wiring.heartbeat
        # this launch attempt's keys ("nvrx/": the nvrx engine's own)
        self.ns = run_namespace(wiring.run_id, launch.attempt, namespace)
        self.run_dir: Path = (
            wiring.events.path.parent if wiring.events.path is not None else cfg.events.dir / wiring.run_id
        )
        # the in-memory ring's cadence; ``ring_share``: its part of the snapshot budget (the rest:
        # the built-in engine's mirror under `resilient launch`)
        self.schedule = SnapshotSchedule(
            cfg.snapshot, self.rank, self.store, f"{self.ns}/snapshot_interval", ring_share
        )
        self.generation = 0

    # -- start-up and end ---------------------------------------------------------------------------
    def open(self, step: Callable[[], int | None]) -> None:
        """The heartbeat (``step``: the step in progress, for the agent), ``run_started``, the
        metrics endpoint under plain torchrun."""
        if self.heartbeat is not None:  # under `resilient launch`: the agent watches it
            self.heartbeat.start(step)
        if self.backend == "nccl":
            torch.cuda.set_device(self.local_rank)
        self.events.emit(
            Event.RUN_STARTED,
            generation=0,
            step=None,
            world_size=self.world_size,
            backend=self.backend,
            hang_timeout=self.t.hang,
            collective_timeout=self.t.collective,
            engine=self.engine,
            max_recoveries=self.cfg.restart.max_recoveries,
            restart_window_s=self.cfg.restart.window_s,
            store_names=names.describe(),
        )
        self._serve_metrics()

    def start_hooks(self) -> None:
        info = RunInfo(
            self.rank, self.world_size, self.engine, self.cfg, self.launch, self.events, self.run_dir
        )
        for h in self.hooks:
            h.on_start(info)

    def _serve_metrics(self) -> None:
        """Under plain torchrun, local rank 0 serves the run's metrics (``metrics.port``); under
        ``resilient launch --metrics-port`` the agent does, reading the same log."""
        m = self.cfg.metrics
        if m.port is None or self.local_rank != 0 or os.environ.get(Var.METRICS_BY_AGENT):
            return
        log = self.events.path
        if log is None:
            return
        from resilient.metrics.exporter import Exporter, RunMetrics

        slurm = self.launch.slurm
        labels = {"slurm_job_id": slurm.job} if slurm is not None else None
        metrics = RunMetrics(log, run_id=self.run_id, refresh_s=m.refresh_s, labels=labels)
        ex = Exporter(metrics, m.port, m.addr, poll_s=min(1.0, m.refresh_s))
        if ex.start():
            self.wiring.on_close.append(ex.close)

    def all_hold(self, name: str, value: str, timeout: float) -> bool:
        """Whether every rank holds ``value`` (a flat count on the job's store, under ``name``)."""
        return all_hold(self.store, f"{self.ns}/{name}", self.world_size, value, timeout)

    def close(self) -> None:
        """Release what the wiring brought, the event log last; every step runs."""
        with contextlib.ExitStack() as stack:
            stack.callback(self.events.close)
            for fn in reversed(self.wiring.on_close):
                stack.callback(fn)
            if self.heartbeat is not None:
                stack.callback(self.heartbeat.close)
        self.store = None  # type: ignore[assignment]  # release the connection

    # -- what every engine records of a fault -----------------------------------------------------------
    def fault_detected(
        self, gen: int, step: int | None, primary: FaultRecord, local: str, noticed_ts: float | None = None
    ) -> None:
        """``noticed_ts``: when this rank learned of the fault (its own exception caught, or its
        listener hearing a peer's), the end of the recovery's detection phase on this rank."""
        self.events.emit(
            Event.FAULT_DETECTED,
            generation=gen,
            step=step,
            kind=primary.kind,
            signature=primary.signature,
            origin_rank=primary.rank,
            origin_step=primary.step,
            origin_ts=primary.ts,
            origin_latency_s=primary.latency_s,
            local=local,
            noticed_ts=noticed_ts,
            cpu_s=time.thread_time(),
        )

    def fault_report(self, rec: FaultRecord, *, tb: str | None = None, stacks: str | None = None) -> None:
        """What the rank a fault happened to saw: its traceback, or (a hang) every thread's stack,
        where the main thread was, and how many collectives the group had issued."""
        where, in_collective = main_thread_where()
        self.events.emit(
            Event.FAULT_REPORT,
            generation=rec.generation,
            step=rec.step,
            kind=rec.kind,
            signature=rec.signature,
            message=rec.message,
            where=where,
            in_collective=in_collective,
            collectives_issued=issued_on_default_group(),
            traceback=tb,
            stacks=stacks,
            log=False,
        )

    def check_health(
        self, gen: int, step: int | None, store: dist.Store, tell_peers: Callable[[int, str], None]
    ) -> None:
        """The built-in and the caller's checks (``store``: the one whose round trip is timed, the
        one this rank uses); a failure is told to the launcher's agent (a node that keeps failing
        them is excluded) and to the peers (``tell_peers``), then raised."""
        t0 = time.time()
        results = run_checks(HealthInput.of(self.rank, gen, store, self.cfg), self.checks)
        failed = [r for r in results if not r.ok]
        self.events.emit(
            Event.HEALTH_CHECKED,
            generation=gen,
            step=step,
            ok=not failed,
            duration_s=time.time() - t0,
            checks={r.name: {"ok": r.ok, "value": r.value} for r in results},
            cpu_s=time.thread_time(),
        )
        if not failed:
            return
        f = failed[0]
        logger.error("rank {}: health check {!r} failed: value={} ({})", self.rank, f.name, f.value, f.detail)
        if self.launch.heartbeat_dir is not None:
            mark_unhealthy(self.launch.heartbeat_dir, self.local_rank, f.name, f.value, f.detail)
        tell_peers(gen, f"health check {f.name!r} failed: {f.value}")
        raise HealthCheckFailed(f.name, f.value, f.detail)
