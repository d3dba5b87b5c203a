"""Silent data corruption: this rank's digests of its replicated state, when they are due, and who
was corrupt once replicas were found to differ.

The digests (:mod:`resilient.state.digest`) ride the collective count (:mod:`.collectives`):
posted with it where a window closes, compared with the next replica's, a difference raised as
:class:`SilentCorruption` and every snapshot after the window dropped, so the
ranks roll back to the newest state whose digests agreed and replay. Who was corrupt:

- **three replicas or more**: in the recovery (only then) every rank contributes the digests of its
  last windows (:meth:`ReplicaCheck.attribute`, one exchange on the store); in the first window
  where a group's members differ, the members outside the majority are named (``sdc_detected``).
  The healthy replicas are equal to one another even when the corrupt one's gradients were
  averaged into theirs, so a majority is exact.
- **two replicas**: no majority. After the roll-back, the replay closes the same window again;
  once its digests agreed (:meth:`ReplicaCheck.agreed`), a deterministic replay has reproduced the
  healthy state: the replica whose digest before the fault equals the replayed one was healthy, the
  other corrupt. This decides only when the corruption did not reach the healthy replica first
  (the flip came after the window's last gradient all-reduce): once the corrupt replica's
  gradients were averaged into both, both digests change under replay and the verdict is
  ``undecided``, never a wrong name.

A rank named twice is marked unhealthy for the launcher and exits as a hard fault
(:class:`CorruptReplica`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Literal

from loguru import logger
from pydantic import Field, field_validator

from resilient.detectors.base import Detector, Run
from resilient.errors import HardFault, SoftFault
from resilient.events import Event
from resilient.sections import Section, interval_or_auto
from resilient.state.digest import Group, Leaf, digest, group_id, leaf_sums, replica_sets

KEEP = 3  # windows whose digests are kept for the attribution (the one that differed is among them)
STRIKES = 2  # found corrupt this many times: the rank's hardware is not trusted any more


class SdcConfig(Section):
    """Silent data corruption: digests of the replicated state (DDP parameters and their
    optimizer's state, DTensor replicas) compared across replicas where the collective count is.

    ``interval: auto`` digests every state the collective check verifies (the ring's snapshot
    cadence, as the schedule picks it within the snapshot budget) and at least every
    ``max_interval`` steps; an int digests every N steps (and at every kept state). A mismatch is
    a soft fault (``sdc``): every rank rolls back to the newest snapshot whose digests agreed.
    """

    enabled: bool = Field(True, description="compare digests of the replicated state across replicas")
    interval: int | Literal["auto"] = Field(
        "auto", description="every N completed steps, or auto: wherever state is kept (see max_interval)"
    )
    max_interval: int = Field(
        100, ge=1, description="auto: also every this many steps when state is kept less often"
    )

    _positive = field_validator("interval")(classmethod(lambda cls, v: interval_or_auto(v)))


class SilentCorruption(SoftFault):
    """Replicas of the same state differ (a flipped bit: silent data corruption), found by
    comparing digests where the collective count is compared. ``window_end``: the step after which
    they were compared; state kept after it is not a good state. ``window_start``: the window's
    first step, whose start was the last state found good. ``ranks``: the two that differ."""

    symptom: ClassVar[str] = "sdc"
    signature_text: ClassVar[str] = "sdc: SilentCorruption: replicas differ"  # (the digests vary)
    rolls_back: ClassVar[bool] = True
    doubts_state: ClassVar[str | None] = "replicas differed"

    def __init__(
        self,
        message: str,
        window_end: int,
        ranks: tuple[int, int] = (-1, -1),
        window_start: int | None = None,
    ) -> None:
        super().__init__(message)
        self.window_end = window_end
        self.window_start = window_end if window_start is None else window_start
        self.ranks = ranks


class CorruptReplica(HardFault):
    """This rank's replica was found corrupt a second time: its hardware is not trusted any more.
    ``replaced``: under ``resilient launch`` it marked itself for replacement, and its agent puts a
    standby in its place while its peers wait in their recovery; else the group exits (75)."""

    symptom: ClassVar[str] = "sdc"
    signature_text: ClassVar[str] = "sdc: CorruptReplica: replicas differ"
    rolls_back: ClassVar[bool] = True
    doubts_state: ClassVar[str | None] = "replicas differed"

    def __init__(self, message: str, replaced: bool = False) -> None:
        super().__init__(message)
        self.replaced = replaced


SDC = SilentCorruption.symptom


class ReplicaCheck(Detector):
    """See the module docstring: one per process (it outlives generations)."""

    name = "replicas"
    summary = "replicas of the same state that differ (a flipped bit): exact digests, compared with the count"
    section = "sdc"
    config = SdcConfig
    faults = (SilentCorruption, CorruptReplica)
    evidence = (Event.SDC_DETECTED,)

    @classmethod
    def build(cls, section: SdcConfig, run: Run) -> ReplicaCheck | None:
        return cls(section, run) if section.enabled else None

    def __init__(self, cfg: SdcConfig, session: Run) -> None:
        self.cfg = cfg
        self.session = session
        self.history: dict[int, dict[Group, str]] = {}  # window end -> this rank's digests
        self.awaiting: dict[int, dict[Group, dict[int, str]]] = {}  # replay verdicts, by window end
        self.strikes = 0  # times this rank was found corrupt

    def due(self, nxt: int) -> bool:
        """Whether a window closes after ``nxt`` completed steps for the digest's sake alone
        (wherever state is kept, one closes anyway)."""
        every = self.cfg.interval if isinstance(self.cfg.interval, int) else self.cfg.max_interval
        return nxt % every == 0

    def digests(
        self, step: int, state: Mapping[str, Any], objects: Mapping[str, Any]
    ) -> tuple[dict[Group, str], dict[str, Leaf]]:
        """The digests of ``state`` (captured after ``step``) by replica group, and every tensor
        leaf's sum (a snapshot of ``state`` is verified against them before it is restored)."""
        s = self.session
        sums = leaf_sums(state)
        sets = replica_sets(state, objects, s.rank, s.world_size)
        mine = {g: digest((p, sums[p]) for p in paths) for g, paths in sets.items()}
        self.history[step] = mine
        for old in sorted(self.history)[:-KEEP]:
            del self.history[old]
        return mine, sums

    # -- who was corrupt ---------------------------------------------------------------------------------
    def attribute(self, gen: int, exchange: Callable[[int, str, str], list[str]]) -> None:
        """In the recovery from an ``sdc`` fault, on every rank: the digests of the last windows
        exchanged, the minority of each group named (or, with two replicas, its replay awaited)."""
        s = self.session
        mine = {str(step): {group_id(g): d for g, d in ds.items()} for step, ds in self.history.items()}
        posted = [json.loads(p) for p in exchange(gen, "sdc", json.dumps(mine))]
        for group in {g for ds in self.history.values() for g in ds}:
            gid = group_id(group)
            for step in sorted(self.history):
                seen = {m: d for m in group if (d := posted[m].get(str(step), {}).get(gid)) is not None}
                if len(set(seen.values())) <= 1:
                    continue
                counts = {d: list(seen.values()).count(d) for d in set(seen.values())}
                top = max(counts, key=lambda d: counts[d])
                if len(seen) >= 3 and counts[top] * 2 > len(seen):
                    corrupt = sorted(m for m, d in seen.items() if d != top)
                    self._named(gen, step, group, corrupt, seen, "majority")
                else:  # (two replicas, or no majority): the replay decides
                    self.awaiting[step] = {**self.awaiting.get(step, {}), group: seen}
                    s.events.emit(
                        Event.SDC_DETECTED,
                        generation=gen,
                        step=step,
                        ranks=[],
                        suspects=sorted(seen),
                        group=list(group),
                        digests={str(m): d for m, d in seen.items()},
                        how="replay pending",
                    )
                break  # (the first window that differs: later ones inherit it)

    def agreed(self, step: int) -> None:
        """The window ending with ``step`` was compared and agreed: a replay awaited there decides
        which replica was corrupt before the roll-back."""
        before = self.awaiting.pop(step, None)
        if before is None:
            return
        for group, seen in before.items():
            now = self.history.get(step, {}).get(group)
            same = sorted(m for m, d in seen.items() if d == now)
            other = sorted(m for m, d in seen.items() if d != now)
            if now is not None and same and other:
                self._named(self.session.generation, step, group, other, seen, "replay")
            else:
                self.session.events.emit(
                    Event.SDC_DETECTED,
                    generation=self.session.generation,
                    step=step,
                    ranks=[],
                    suspects=sorted(seen),
                    group=list(group),
                    digests={str(m): d for m, d in seen.items()},
                    how="undecided",
                    replayed=now,
                )

    def _named(
        self, gen: int, step: int, group: Group, corrupt: list[int], seen: Mapping[int, str], how: str
    ) -> None:
        s = self.session
        s.events.emit(
            Event.SDC_DETECTED,
            generation=gen,
            step=step,
            ranks=corrupt,
            suspects=sorted(seen),
            group=list(group),
            digests={str(m): d for m, d in seen.items()},
            how=how,
        )
        if s.rank not in corrupt:
            return
        self.strikes += 1
        logger.error("rank {}: its replica was corrupt after step {} ({}x)", s.rank, step, self.strikes)
        if self.strikes < STRIKES:
            return
        detail = f"replica found corrupt {self.strikes} times (last after step {step})"
        replaced = s.mark_replace({"cause": f"sdc: {detail}"})
        then = "a standby takes its rank" if replaced else "the group exits for a relaunch"
        raise CorruptReplica(f"rank {s.rank}: {detail}; {then}", replaced)
