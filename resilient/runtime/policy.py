"""Restart policy: bounded restarts, a sliding time window, backoff, and repeat diagnosis.

Every rank evaluates the policy on the same input — the *primary* fault record of the
generation, which the store holds once for all ranks — so every rank reaches the same verdict
and nobody waits at a barrier for a rank that already gave up. Clock and randomness are
injectable so tests never wait on the wall clock.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict

from resilient.backoff import Backoff
from resilient.config import RestartConfig
from resilient.errors import FaultRepeats, RestartBudgetExhausted
from resilient.runtime.faults import FaultRecord


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
        self._restarts: deque[float] = deque()
        self.history: list[FaultRecord] = []
        self._backoff = Backoff(cfg.backoff_initial_s, cfg.backoff_max_s)

    def _repeat_count(self, fault: FaultRecord) -> int:
        n = 0
        for past in reversed(self.history):
            if past.step == fault.step and past.signature == fault.signature:
                n += 1
            else:
                break
        return n

    def admit(self, fault: FaultRecord) -> float:
        """Record ``fault``; return the backoff delay in seconds, or raise if no restart is allowed.

        Raises :class:`FaultRepeats` when the same signature hit the same step ``max_repeats`` times
        in a row, and :class:`RestartBudgetExhausted` when ``max_restarts`` restarts already happened
        within ``window_s``.
        """
        self.history.append(fault)
        hist = [asdict(f) for f in self.history]
        repeats = self._repeat_count(fault)
        if repeats >= self.cfg.max_repeats:
            raise FaultRepeats(fault.step if fault.step is not None else -1, fault.signature, repeats, hist)
        now = fault.ts if fault.ts else self._clock()  # the origin's clock: same verdict on every rank
        while self._restarts and now - self._restarts[0] > self.cfg.window_s:
            self._restarts.popleft()
        if len(self._restarts) >= self.cfg.max_restarts:
            raise RestartBudgetExhausted(
                f"restart budget exhausted: {len(self._restarts)} restarts within {self.cfg.window_s:g}s "
                f"(max_restarts={self.cfg.max_restarts}); last fault at step {fault.step}: {fault.signature}",
                hist,
            )
        self._restarts.append(now)
        return self._backoff.delay(len(self._restarts), self._rng)  # n-th restart inside the window
