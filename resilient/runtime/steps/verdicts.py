"""The collective check's verdicts on what the ring keeps: a window compared, and on a desync (or
replicas that differ) the snapshots kept after it dropped before the fault is raised; at a
fault, a snapshot nothing proved good dropped before the ranks agree on a restore."""

from __future__ import annotations

from loguru import logger

from resilient.detectors.collectives import CollectiveCount, CollectiveDesync
from resilient.detectors.replicas import ReplicaCheck, SilentCorruption
from resilient.state import SnapshotRing


class Verdicts:
    """What the step loop does with the collective count's comparisons (see the module docstring)."""

    def __init__(self, ring: SnapshotRing, sdc: ReplicaCheck | None, rank: int) -> None:
        self.ring, self.sdc, self.rank = ring, sdc, rank

    def settle(self, count: CollectiveCount, block: bool) -> None:
        """Compare the pending window; once its digests agreed, a replay awaited there decides."""
        end = count.pending
        try:
            count.settle(block)
        except (CollectiveDesync, SilentCorruption) as e:
            self.ring.drop_after(e.window_end)
            raise
        if self.sdc is not None and end is not None and count.pending is None:
            self.sdc.agreed(end)

    def before_restore(self, count: CollectiveCount | None) -> None:
        """A fault came while the newest snapshot was unverified: compare now if the neighbour's
        count is there, else drop that snapshot (nothing proves it good). With ``sdc``, a
        snapshot whose copy no longer matches its digests is dropped too."""
        if self.sdc is not None:
            for step, why in self.ring.drop_corrupt():
                logger.error("rank {}: snapshot of step {} corrupt, not restored: {}", self.rank, step, why)
        if count is None or count.pending is None:
            return
        end = count.pending
        try:
            if count.settle(block=False, running=False):  # (in a recovery: nobody posts now)
                return
        except (CollectiveDesync, SilentCorruption):
            pass
        except Exception as e:  # the store may be what failed: no proof either way
            logger.debug("rank {}: collective count not compared: {}", self.rank, e)
        self.ring.drop_after(end)
