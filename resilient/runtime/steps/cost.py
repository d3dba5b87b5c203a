"""What the runtime costs the main thread in steady state, and the ``progress`` events that say so."""

from __future__ import annotations

from resilient.events import Event
from resilient.runtime.run.session import Session


class Cost:
    """What the runtime costs the main thread in steady state, and the ``progress`` events that
    report it (at most one every ``events.progress_s``; ``run_finished`` reports the total)."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.steps = 0
        self.snapshots = 0
        self.hook_s = 0.0  # time in the per-step hook: progress, timer, snapshot copy
        self._progress_at: tuple[float, int] | None = None  # (clock, steps) of the last progress event

    @property
    def ms_per_step(self) -> float:
        return 1e3 * self.hook_s / max(1, self.steps)

    def add(self, step: int, now: float, hook_s: float, snapshot: bool) -> None:
        """Step ``step``, completed at ``now``, cost the main thread ``hook_s``."""
        self.steps += 1
        self.snapshots += snapshot
        self.hook_s += hook_s
        last = self._progress_at
        s = self.session
        if last is not None and now - last[0] < s.cfg.events.progress_s:
            return
        self._progress_at = (now, self.steps)
        s.events.emit(
            Event.PROGRESS,
            generation=s.generation,
            step=step,
            first=last is None,
            steps_completed=self.steps,
            step_s=None if last is None else (now - last[0]) / max(1, self.steps - last[1]),
            runtime_ms_per_step=self.ms_per_step,
            snapshot_interval=s.schedule.interval,
            log=False,
        )
