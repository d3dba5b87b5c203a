"""What a completed step keeps: its state captured where the schedule (the ring), the keeper
(shared memory, a checkpoint) or the replica digests want it, and verified first by the collective
count's window (state that leaves the process is verified at once; the ring's, at the next step)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from resilient.detectors.replicas import ReplicaCheck
from resilient.runtime.keeping.buckets import DdpBuckets
from resilient.runtime.run.generation import Generation
from resilient.runtime.run.session import Session
from resilient.runtime.steps.keeper import Keeper
from resilient.runtime.steps.replay import ReplayCheck
from resilient.runtime.steps.verdicts import Verdicts
from resilient.state import SnapshotRing
from resilient.state.digest import Leaf


@dataclass
class Kept:
    """A step's kept state (None: nothing wanted it), its leaves' sums (with the replica
    digests), and how long the ring's capture took (None: no ring capture)."""

    state: dict[str, Any] | None = None
    sums: dict[str, Leaf] | None = None
    capture_s: float | None = None


class StepKeeping:
    """See the module docstring: one per run, asked at every step's end."""

    def __init__(
        self,
        session: Session,
        keeper: Keeper,
        ring: SnapshotRing,
        *,
        buckets: DdpBuckets,
        replay: ReplayCheck,
        verdicts: Verdicts,
        sdc: ReplicaCheck | None,
    ) -> None:
        self.session = session
        self.keeper = keeper
        self.ring = ring
        self.buckets = buckets
        self.replay = replay
        self.verdicts = verdicts
        self.sdc = sdc

    def at_step_end(self, gen: Generation, step: int, total: int | None, now: float) -> Kept:
        """Step ``step`` of ``gen`` completed at ``now``: what the next step's start keeps."""
        nxt, count, sdc = step + 1, gen.count, self.sdc
        if count is not None and count.pending is not None:  # the last kept snapshot, verified now
            self.verdicts.settle(count, False)
        leaves = self.keeper.due(nxt, total) or nxt == total  # (the last: returned to the caller)
        ring_due = self.session.schedule.due(nxt, total)
        if self.keeper.stopping():
            # kept in the ring, its count posted but not awaited: a peer that saw the signal a
            # step later waits in the next step's collectives, not here; the recovery that the
            # stop starts verifies the count once every rank arrived (Recovery._preempt)
            ring_due, leaves = True, False
        digest_due = sdc is not None and count is not None and sdc.due(nxt)
        if not (ring_due or leaves or digest_due):
            return Kept()
        kept = Kept(gen.registry.capture())
        assert kept.state is not None
        digests = None
        if sdc is not None and count is not None:  # the replicated state's digests, with the count
            objects = dict(zip(gen.registry.names(), gen.registry.objects(), strict=True))
            digests, kept.sums = sdc.digests(step, kept.state, objects)
        if count is not None:  # every rank issued the same collectives, or nothing is kept
            if count.pending is not None:  # (a window still open from a step that kept no state)
                self.verdicts.settle(count, True)
            # state that leaves the process is verified first; the ring's, at the next step
            count.close_window(step, digests)
            if leaves:
                self.verdicts.settle(count, True)
        self.buckets.observe(gen.registry.objects())
        if ring_due:
            self.ring.capture(nxt, kept.state, kept.sums)
            kept.capture_s = self.session.clock() - now
            self.replay.snapshot_at(nxt, min(self.ring.steps(), default=None))
        return kept
