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
from collections.abc import Callable
from pathlib import Path

import torch

from resilient import points
from resilient.contract import run_namespace
from resilient.events import Event, EventLog
from resilient.launch_env import Var
from resilient.native import names
from resilient.runtime.coordination.agreement import all_hold
from resilient.runtime.hooks import RunInfo, at_point
from resilient.runtime.run.checkup import Checkup
from resilient.runtime.run.record import FaultRecorder
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
        self.record = FaultRecorder(self.events)
        self.checkup = Checkup(
            cfg, setup.checks, self.events, self.rank, self.local_rank, launch.heartbeat_dir
        )

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
        if self.hooks:  # (the points code outside the run reaches: a checkpoint's commit)
            self.wiring.on_close.append(points.listen(self.at_point))

    def at_point(self, phase: str, step: int | None) -> None:
        """The hooks told that a recovery reached ``phase`` (hooks.POINTS); raises what they raise."""
        if self.hooks:
            at_point(self.hooks, phase, self.generation, step)

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
