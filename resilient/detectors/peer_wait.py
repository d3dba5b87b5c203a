"""What a rank's step check waits for while it waits for a peer's collective count
(:mod:`.collectives`): the monitor thread reads it, and says a wait that lasts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class PeerWait:
    """What this rank's main thread waits for in a step check, while it does (the monitor thread
    reads it: a wait longer than ``peer_report`` is said, with what holds it up)."""

    key: str
    peer: int
    since: float  # time.monotonic() when the wait began
    request_since: float | None = None  # a store request in flight since then (None: between two)
    reads: int = 0
    slowest_s: float = 0.0  # the slowest store request so far
    reported: bool = False

    def cause(self, now: float, bound: float) -> str:
        """``store``: a request has been in flight for half the bound or more (the store, not the
        peer, holds it up); else ``peer`` (its count is not posted yet: it is behind, or hangs)."""
        in_flight = now - self.request_since if self.request_since is not None else 0.0
        return "store" if max(in_flight, self.slowest_s) >= 0.5 * bound else "peer"

    def fields(self, waited_s: float) -> dict[str, Any]:
        """The ``peer_wait`` event's fields, said while it lasts and when it ended."""
        return {
            "peer": self.peer,
            "key": self.key,
            "waited_s": round(waited_s, 4),
            "reads": self.reads,
            "slowest_request_s": round(self.slowest_s, 4),
        }

    def describe(self, now: float, bound: float) -> str:
        in_flight = now - self.request_since if self.request_since is not None else None
        what = (
            f"its store request in flight for {in_flight:.2f} s"
            if in_flight is not None and self.cause(now, bound) == "store"
            else f"rank {self.peer} has not posted it ({self.reads} reads, "
            f"slowest {self.slowest_s * 1e3:.1f} ms)"
        )
        return f"waits {now - self.since:.2f} s for rank {self.peer}'s collective count ({self.key}): {what}"
