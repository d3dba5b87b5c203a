"""What a recovery asks of the step loop's state, apart from the loop: this rank's offer at the
recovery barrier (the live step it vouches for, or a replacement's predecessor's capture), DDP's
layouts as the failed generation left them, and the agreed step's state made ready for the next
generation (:class:`~resilient.runtime.run.generation.PendingRestore`), and loaded once the
function re-entered (:meth:`Restorer.resumed`). Both engines' recoveries use it."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from resilient.detectors import Detectors
from resilient.events import Event
from resilient.runtime.coordination.agreement import RestorePlan
from resilient.runtime.keeping import buddy
from resilient.runtime.keeping.buckets import AllSame, DdpBuckets
from resilient.runtime.run.generation import Generation, PendingRestore
from resilient.runtime.run.session import Session
from resilient.runtime.steps.handover import Handover
from resilient.runtime.steps.keeper import Keeper
from resilient.runtime.steps.live import LiveResume
from resilient.runtime.steps.replay import ReplayCheck
from resilient.runtime.steps.verdicts import Verdicts
from resilient.state import SnapshotRing


class Restorer:
    """See the module docstring. ``gen``: the generation that ended (the step loop's current one)."""

    def __init__(
        self,
        session: Session,
        gen: Callable[[], Generation],
        *,
        keeper: Keeper,
        ring: SnapshotRing,
        buckets: DdpBuckets,
        live: LiveResume,
        handover: Handover,
        verdicts: Verdicts,
        detectors: Detectors,
        replay: ReplayCheck,
    ) -> None:
        self.session = session
        self.gen = gen
        self.keeper = keeper
        self.ring = ring
        self.buckets = buckets
        self.live = live
        self.handover = handover
        self.verdicts = verdicts
        self.detectors = detectors
        self.replay = replay
        self.parts: dict[str, float] = {}  # the last prepare's parts (docs/recovery.md#phases)

    def settle(self) -> None:
        """The snapshot kept at the failed step is verified or dropped for good: every rank posted
        every collective count it ever will once it is in the recovery."""
        self.verdicts.before_restore(self.gen().count)

    def offer(self, symptom: str | None) -> dict[str, Any]:
        """The step this rank can resume at from its live state, or why it cannot (live.py)."""
        registry = self.gen().registry
        return self.handover.vouch(self.live.offer(symptom, registry), symptom, registry)

    def replacement_offer(self, generation: int, predecessor: int | None) -> dict[str, Any]:
        """A replacement's offer: its predecessor's last capture (handover.py)."""
        return self.handover.replacement_offer(generation, predecessor)

    def offered_steps(self, held: list[int], joining: bool) -> list[int]:
        """The snapshot steps this rank offers at the recovery barrier: those it ``held`` (ring,
        shared memory); a replacement (``joining``) holding none on its node, its lost node's
        predecessor's steps that the store copy and a peer restore (handover.py)."""
        return held if held or not joining else self.handover.stored_steps()

    def layout_digest(self) -> str:
        """DDP's bucket layouts as the generation that ended left them (offered at the recovery
        barrier, whose verdict :meth:`prepare` applies)."""
        return self.buckets.ended(self.gen().registry.objects())

    def prepare(
        self,
        generation: int,
        step: int,
        fault_step: int | None,
        fault_ts: float | None,
        all_same: AllSame,
        plan: RestorePlan | None = None,
        since: int | None = None,
    ) -> PendingRestore:
        """The agreed ``step``'s state (the ``plan``'s live step: the live objects' at the step
        every rank vouched for, or its donors' for a replacement; else its snapshot, or for a
        replacement from another node the store copy and its ring donor's), to be loaded into
        each object as the function tracks it in the next generation (``generation``: the one
        that ended)."""
        plan = plan or RestorePlan()
        t0 = time.monotonic()
        registry = self.gen().registry
        self.buckets.at_recovery(registry.objects(), generation, step, all_same, self.session.t.barrier)
        t1 = time.monotonic()
        r = self._state(step, plan)
        r.fault_step, r.fault_ts, r.since = fault_step, fault_ts, since
        t2 = time.monotonic()
        self.ring.drop_after(step)
        self.keeper.drop_after(step)
        self.parts = {"layouts_s": t1 - t0, "materialize_s": t2 - t1, "drop_s": time.monotonic() - t2}
        return r

    def _state(self, step: int, plan: RestorePlan) -> PendingRestore:
        """Where ``step``'s state comes from on this rank, and to whom it goes on."""
        me = self.session.rank
        donors, ring_donors = plan.live_donors or {}, plan.ring_donors or {}

        def pending(state: dict[str, Any], source: str, owned: bool = True, **to: Any) -> PendingRestore:
            return PendingRestore(step, state, owned, None, None, source=source, **to)

        if plan.live is not None and str(me) in donors:  # (a replacement: handover.py)
            return pending(self.handover.replacement_state(donors[str(me)]), "peer")
        if plan.live is not None:
            send_to = sorted(int(r) for r, q in donors.items() if q == me)
            return pending(self.live.state(self.gen().registry), "live", send_to=send_to)
        if self.handover.stored:  # (a replacement from another node: handover.py)
            holder = (plan.ring_buddies or {}).get(str(me))
            if holder is None:
                return pending(self.handover.stored_state(step, ring_donors.get(str(me))), "store+peer")
            at = buddy.address(self.session.store, buddy.prefix(self.session.run_id), holder)
            return pending(self.handover.stored_state(step, None, at), "store+buddy")
        state, owned = self.keeper.materialize(step)
        send_to = sorted(int(r) for r, q in ring_donors.items() if q == me)
        only = {int(r): names for r, names in (plan.ring_names or {}).items()}
        return pending(state, "ring" if owned else "shm", owned, send_to=send_to, send_only=only)

    def resumed(self, r: PendingRestore, began: float | None) -> None:
        """At the re-entered function's first ``ctx.steps``: every object of the snapshot was
        tracked again and loaded; the RNGs are restored last (``began``: when the restored step
        first began, for the work the fault threw away)."""
        r.finish()
        self.detectors.each(lambda d: d.restored(r.step))
        s = self.session
        s.events.emit(
            Event.STATE_RESTORED,
            generation=s.generation,
            step=r.step,
            snapshot_interval=s.schedule.interval,
            **r.described(began),
        )
        self.replay.restored(r.step, r.fault_step, r.source, s.generation, since=r.since)
