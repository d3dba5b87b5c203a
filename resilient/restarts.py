"""The two rules every restart decision here shares: the sliding restart window and the repeat rule.

The in-process runtime (:class:`resilient.runtime.recovery.policy.RestartPolicy`) and the launcher
(:class:`resilient.launcher.policy.LaunchPolicy`) both allow a number of restarts within a
window and stop a fault that keeps coming back at the same place; one implementation of each
keeps their verdicts alike. Time is passed in, never read here: each caller's clock decides (the
fault's origin for the runtime, the agent's monotonic clock for the launcher), so tests never wait.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

T = TypeVar("T")


class RestartWindow:
    """At most ``limit`` restarts within any ``span_s`` seconds (``span_s=None``: within the whole
    run, as torchrun counts ``--max-restarts``). A negative ``limit`` allows none.

    Times are admitted in order; a restart older than ``span_s`` at the time asked about is
    forgotten: a job that fails once a day for a month is not a job that fails in a loop.
    """

    def __init__(self, limit: int, span_s: float | None = None) -> None:
        self.limit = limit
        self.span_s = span_s
        self._times: deque[float] = deque()

    def count(self, now: float) -> int:
        """The restarts inside the window that ends at ``now``."""
        if self.span_s is not None:
            while self._times and now - self._times[0] > self.span_s:
                self._times.popleft()
        return len(self._times)

    def left(self, now: float) -> int:
        """How many more restarts the window allows at ``now``."""
        return max(0, self.limit - self.count(now))

    def admit(self, now: float) -> bool:
        """Record a restart at ``now`` if one is left; False (and nothing recorded) when spent."""
        if self.count(now) >= self.limit:
            return False
        self._times.append(now)
        return True


def repeats(history: Sequence[T], key: Callable[[T], Hashable] | None = None) -> int:
    """How many entries at the end of ``history`` are the same (by ``key``) as its last one: 3 for
    ``[a, b, b, b]``, 0 for an empty history. A fault repeats when this reaches ``max_repeats``;
    any other entry in between (progress was made, another rank failed) starts the count again."""
    if not history:
        return 0
    same = key or (lambda x: x)
    last = same(history[-1])
    n = 0
    for entry in reversed(history):
        if same(entry) != last:
            break
        n += 1
    return n
