"""The health checks a recovery runs (the built-in ones the config names and the caller's), their
verdict written to the event log, and a failure told to the launcher's agent and to the peers."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch.distributed as dist
from loguru import logger

from resilient.config import Config
from resilient.contract import mark_unhealthy
from resilient.errors import HealthCheckFailed
from resilient.events import Event, EventLog
from resilient.health import Check, HealthInput, run_checks


class Checkup:
    """See the module docstring. ``heartbeat_dir``: the agent's (under ``resilient launch``),
    where a failed check marks this local rank unhealthy so that a node that keeps failing them
    is excluded."""

    def __init__(
        self,
        cfg: Config,
        checks: Sequence[Check],
        events: EventLog,
        rank: int,
        local_rank: int,
        heartbeat_dir: Path | None,
    ) -> None:
        self.cfg, self.checks, self.events = cfg, checks, events
        self.rank, self.local_rank, self.heartbeat_dir = rank, local_rank, heartbeat_dir

    def run(
        self, gen: int, step: int | None, store: dist.Store, tell_peers: Callable[[int, str], None]
    ) -> None:
        """Run every check (``store``: the one whose round trip is timed, the one this rank uses);
        a failure is marked for the agent, told to the peers (``tell_peers``), then raised."""
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
        if self.heartbeat_dir is not None:
            mark_unhealthy(self.heartbeat_dir, self.local_rank, f.name, f.value, f.detail)
        tell_peers(gen, f"health check {f.name!r} failed: {f.value}")
        raise HealthCheckFailed(f.name, f.value, f.detail)
