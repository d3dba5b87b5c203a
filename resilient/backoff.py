"""Backoff between quick restarts: one schedule for the in-process runtime and the launcher.

The first restart is immediate (most faults are one-offs); each further restart in a row waits
twice as long as the one before, from ``initial_s`` up to ``max_s``. Jitter, when a random source
is given, spreads the ranks or nodes of a job that restart together; it is drawn from the caller's
own ``random.Random``, never the global one, which belongs to the user's tracked RNG state.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    initial_s: float
    max_s: float

    def delay(self, n: int, rng: random.Random | None = None) -> float:
        """Seconds to wait before the ``n``-th restart in a row (1-based)."""
        if n <= 1 or self.initial_s <= 0:
            return 0.0
        base = self.initial_s * 2.0 ** (n - 2)
        jitter = rng.uniform(0, self.initial_s) if rng is not None else 0.0
        return min(base + jitter, self.max_s)
