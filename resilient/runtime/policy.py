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

import tenacity

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
        # tenacity's jitter draws from the global ``random`` module, which belongs to the user's
        # (tracked, restored) RNG state; the exponential part comes from tenacity, the jitter from ours.
        self._wait = tenacity.wait_exponential(multiplier=cfg.backoff_initial_s, max=cfg.backoff_max_s)

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
        quick = len(self._restarts)  # restarts still inside the window
        self._restarts.append(now)
        if quick == 0:
            return 0.0
        state = tenacity.RetryCallState(None, None, (), {})  # type: ignore[arg-type]
        state.attempt_number = quick
        delay = float(self._wait(state)) + self._rng.uniform(0, self.cfg.backoff_initial_s)
        return min(delay, self.cfg.backoff_max_s)
