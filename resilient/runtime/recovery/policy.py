"""Restart policy: bounded restarts, a sliding time window, backoff, and repeat diagnosis.

Every rank evaluates the policy on the same input — the *primary* fault record of the
generation, which the store holds once for all ranks — so every rank reaches the same verdict
and nobody waits at a barrier for a rank that already gave up. Clock and randomness are
injectable so tests never wait on the wall clock. The window and the repeat rule are
:mod:`resilient.restarts`, shared with the launcher's policy.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import asdict

from resilient.backoff import Backoff
from resilient.config import RestartConfig
from resilient.errors import FaultRepeats, RestartBudgetExhausted
from resilient.restarts import RestartWindow, repeats
from resilient.runtime.faults.records import FaultRecord


def _where(fault: FaultRecord) -> tuple[int | None, str]:
    """A fault is the same fault when it hits the same step with the same signature."""
    return fault.step, fault.signature


class RestartPolicy:
    """Decides whether the run may restart after a fault, and how long to back off first."""

    def __init__(
        self,
        cfg: RestartConfig,
        clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
    ) -> None:
        self.cfg = cfg
        self._clock = clock
        self._rng = rng or random.Random()
        self._window = RestartWindow(cfg.max_recoveries, cfg.window_s)
        self.history: list[FaultRecord] = []
        self._backoff = Backoff(cfg.backoff_initial_s, cfg.backoff_max_s)

    def admit(self, fault: FaultRecord) -> float:
        """Record ``fault``; return the backoff delay in seconds, or raise if no restart is allowed.

        Raises :class:`FaultRepeats` when the same signature hit the same step ``max_repeats`` times
        in a row, and :class:`RestartBudgetExhausted` when ``max_recoveries`` recoveries already happened
        within ``window_s``.
        """
        self.history.append(fault)
        hist = [asdict(f) for f in self.history]
        n = repeats(self.history, _where)
        if n >= self.cfg.max_repeats:
            raise FaultRepeats(fault.step if fault.step is not None else -1, fault.signature, n, hist)
        now = fault.ts if fault.ts else self._clock()  # the origin's clock: same verdict on every rank
        if not self._window.admit(now):
            raise RestartBudgetExhausted(
                f"in-process recovery budget exhausted: {self._window.count(now)} recoveries within "
                f"{self.cfg.window_s:g}s (restart.max_recoveries={self.cfg.max_recoveries}); "
                f"last fault at step {fault.step}: {fault.signature}",
                hist,
            )
        return self._backoff.delay(self._window.count(now), self._rng)  # n-th restart inside the window
