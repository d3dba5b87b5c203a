"""What every engine records of a fault, alike: its detection on each rank (``fault_detected``)
and, on the rank it happened to, its report (``fault_report``: the traceback, or a hang's
stacks, where the main thread was and how many collectives the group had issued)."""

from __future__ import annotations

import time

from resilient.detectors.collectives import issued_on_default_group
from resilient.events import Event, EventLog
from resilient.runtime.faults.records import FaultRecord
from resilient.runtime.faults.stacks import main_thread_where


class FaultRecorder:
    """See the module docstring: one per run, writing to its event log."""

    def __init__(self, events: EventLog) -> None:
        self.events = events

    def detected(
        self, gen: int, step: int | None, primary: FaultRecord, local: str, noticed_ts: float | None = None
    ) -> None:
        """``noticed_ts``: when this rank learned of the fault (its own exception caught, or its
        listener hearing a peer's), the end of the recovery's detection phase on this rank."""
        self.events.emit(
            Event.FAULT_DETECTED,
            generation=gen,
            step=step,
            kind=primary.kind,
            signature=primary.signature,
            origin_rank=primary.rank,
            origin_step=primary.step,
            origin_ts=primary.ts,
            origin_latency_s=primary.latency_s,
            local=local,
            noticed_ts=noticed_ts,
            cpu_s=time.thread_time(),
        )

    def report(self, rec: FaultRecord, *, tb: str | None = None, stacks: str | None = None) -> None:
        """What the rank a fault happened to saw (``tb``: its traceback; ``stacks``: a hang's)."""
        where, in_collective = main_thread_where()
        self.events.emit(
            Event.FAULT_REPORT,
            generation=rec.generation,
            step=rec.step,
            kind=rec.kind,
            signature=rec.signature,
            message=rec.message,
            where=where,
            in_collective=in_collective,
            collectives_issued=issued_on_default_group(),
            traceback=tb,
            stacks=stacks,
            log=False,
        )
