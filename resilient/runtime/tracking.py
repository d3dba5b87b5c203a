"""What both engines do with the objects the training function tracks."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

from resilient.errors import StateRestoreError
from resilient.events import Event, EventLog
from resilient.state import Registry
from resilient.state.registry import RNG, restore_rng


class Tracking:
    """Register tracked objects, load the agreed snapshot into each as it is tracked after a
    restart, and write the final state a certificate compares (``RESILIENT_FINAL_STATE``)."""

    registry: Registry
    rank: int
    generation: int
    step: int | None
    restore_step: int | None
    _restore_state: dict[str, Any] | None
    _restored: set[str]
    _fault_step: int | None
    _fault_ts: float | None

    @property
    def _ev(self) -> EventLog:
        raise NotImplementedError

    def track(self, objects: dict[str, Any]) -> None:
        for name, obj in objects.items():
            self.registry.add(name, obj)
            if self._restore_state is not None:
                if name not in self._restore_state:
                    raise StateRestoreError(
                        f"{name!r} is tracked now but was not in the snapshot of step {self.restore_step} "
                        f"(snapshot holds {sorted(k for k in self._restore_state if k != RNG)})"
                    )
                self.registry.load(name, self._restore_state[name])
                self._restored.add(name)

    def _resume_restored(self, **detail: Any) -> int:
        """At ``ctx.steps`` after a restart: every object of the snapshot was tracked again and
        loaded; the RNGs are restored last, and the step to resume at is returned."""
        assert self._restore_state is not None
        missing = [n for n in self._restore_state if n != RNG and n not in self._restored]
        if missing:
            raise StateRestoreError(f"tracked before the fault but not after the restart: {missing}")
        restore_rng(self._restore_state[RNG])
        step = self.restore_step
        assert step is not None
        self._ev.emit(
            Event.STATE_RESTORED,
            generation=self.generation,
            step=step,
            objects=sorted(self._restored),
            steps_rerun=(self._fault_step if self._fault_step is not None else step) - step,
            since_fault_s=time.time() - (self._fault_ts or time.time()),
            **detail,
        )
        self._restore_state = None
        self.step = step
        return step

    def _save_final_state(self) -> None:
        """``RESILIENT_FINAL_STATE=DIR``: every tracked object's final state → DIR/rank<R>.pt (a
        certificate compares it with a fault-free run's, bit for bit)."""
        out = os.environ.get("RESILIENT_FINAL_STATE")
        if not out:
            return
        Path(out).mkdir(parents=True, exist_ok=True)
        state = {k: v for k, v in self.registry.capture().items() if k != RNG}
        torch.save(state, Path(out) / f"rank{self.rank}.pt")
