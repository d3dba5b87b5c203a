"""What the ranks agree on, reduced once from every rank's payload: the restore a recovery resumes
from (:class:`RestorePlan`), the outcome of a vote, whether every rank holds the same value. Pure
functions of the payloads, plus :func:`all_hold`, the flat count on the store that needs no barrier
(the runtime's start-up check, before the coordinator exists)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from resilient.errors import CoordinationError, SetupFailed, StateRestoreError
from resilient.runtime.faults.records import FaultRecord


@dataclass(frozen=True)
class RestorePlan:
    """The recovery barrier's verdict: reduced once from every rank's payload (:func:`restore_plan`)
    and read by every rank alike, so that every rank restores the same step or raises the same
    error (:meth:`restore_step`)."""

    step: int | None = None  # the newest snapshot step every rank holds
    empty: list[int] = field(default_factory=list)  # ranks holding none: failed before their first step
    malformed: list[int] = field(default_factory=list)  # ranks whose payload is no list of steps
    held: list[list[int]] | None = None  # every rank's steps, where no step is common (the error names them)
    layout_same: bool | None = None  # every rank's DDP bucket layouts alike (None: none posted)
    live: int | None = None  # the step every rank vouched for in its live state (runtime/steps/live.py)
    live_refused: dict[str, str] | None = None  # why not, by rank ("all": for every rank)
    live_donors: dict[str, int] | None = None  # a replacement's rank -> the survivor it takes its state from
    # a replacement from another node (its predecessor's node lost) -> the survivor whose snapshot
    # of ``step`` it takes its large objects from (its small ones: the store copy); why none, by rank
    ring_donors: dict[str, int] | None = None
    ring_names: dict[str, list[str]] | None = None  # ... and which objects (the others: the store copy)
    ring_refused: dict[str, str] | None = None
    # ... or the survivor holding its predecessor's buddy copy of ``step`` (runtime/keeping/buddy.py)
    ring_buddies: dict[str, int] | None = None

    def to_json(self) -> str:
        return json.dumps({k: v for k, v in asdict(self).items() if v is not None})

    @classmethod
    def parse(cls, raw: str | bytes) -> RestorePlan:
        return cls(**json.loads(raw))

    def snapshot_step(self, primary: FaultRecord | None = None) -> int:
        """The snapshot step every rank holds, or the error every rank raises alike (``primary``:
        the fault, named when the rank that holds nothing is its origin)."""
        if self.malformed:
            raise CoordinationError(
                f"ranks {self.malformed} posted malformed snapshot lists to the recovery barrier"
            )
        if self.empty:  # (a peer pulled out before its own first step holds none either: the fault names who)
            if primary is not None and primary.rank in self.empty:
                raise SetupFailed(
                    f"rank {primary.rank} failed before the first step: {primary.message}", self.empty
                )
            raise SetupFailed(
                f"ranks {self.empty} hold no snapshot: they failed before the first step", self.empty
            )
        if self.ring_refused:
            raise StateRestoreError(f"not restorable from memory: {self.ring_refused}")
        if self.step is None:
            raise StateRestoreError(f"no snapshot step held by every rank: {self.held}")
        return self.step

    def restore_step(self, primary: FaultRecord | None = None) -> int:
        """The step the next generation resumes at: the live one every rank vouched for, else
        :meth:`snapshot_step`."""
        return self.live if self.live is not None else self.snapshot_step(primary)


def restore_plan(payloads: list[str]) -> str:
    """The recovery barrier's reduction, a :class:`RestorePlan` as JSON. A payload is a list of
    steps, or ``{"steps": [...], "layout": digest}``: then ``layout_same`` says whether every
    rank's DDP bucket layouts are the same; with a ``"live"`` offer, :func:`live_plan` says whether
    they resume from the live state."""
    held: list[list[int]] = []
    layouts: list[object] = []
    lives: list[Any] = []
    malformed = []
    for r, p in enumerate(payloads):
        try:
            got = json.loads(p)
        except (ValueError, RecursionError):
            got = None
        steps = got.get("steps") if isinstance(got, dict) else got
        if isinstance(got, dict):
            layouts.append(got.get("layout"))
        lives.append(got.get("live") if isinstance(got, dict) else None)  # (by rank)
        if not isinstance(steps, list) or any(type(s) is not int or s < 0 for s in steps):
            malformed.append(r)  # (a peer's garbage: named, and no step is trusted from it)
            steps = []
        held.append(steps)
    if malformed:
        return RestorePlan(malformed=malformed).to_json()
    # a replacement from another node holding nothing did not fail before its first step: its
    # predecessor's memory went with its node (no store copy to take it from)
    bare = {r for r, (s, lv) in enumerate(zip(held, lives, strict=True)) if not s and _replacement(lv)}
    empty = [r for r, s in enumerate(held) if not s and r not in bare]
    common = set(held[0]).intersection(*map(set, held[1:])) if held else set()
    plan: dict[str, Any] = {"step": max(common) if common else None, "empty": empty}
    if not common and not empty:
        plan["held"] = held
    if layouts:  # (every rank or none: the same code posts them)
        plan["layout_same"] = len(layouts) == len(payloads) and len({json.dumps(v) for v in layouts}) == 1
    if any(lv is not None for lv in lives):
        plan.update(live_plan(lives, plan["step"]))
    if plan.get("live") is None and plan["step"] is not None:
        plan.update(ring_plan(lives, sorted(common, reverse=True)))
    if bare:
        why = "a replacement whose predecessor's node was lost holds no state: no store copy of it"
        plan["ring_refused"] = {**(plan.get("ring_refused") or {}), **{str(r): why for r in sorted(bare)}}
    return RestorePlan(**plan).to_json()


def _replacement(offer: Any) -> bool:
    """A replacement's offer at the recovery barrier (``handover.replacement_offer``)."""
    return isinstance(offer, dict) and bool(offer.get("replacement"))


def live_plan(offers: list[Any], ring_step: int | None) -> dict[str, Any]:
    """The live resume's part of the plan: ``live``, the step every rank vouched for after the same
    number of collectives (runtime/steps/live.py), or ``live_refused``: why not, by rank."""
    refused: dict[str, str] = {}
    for r, o in enumerate(offers):
        if not isinstance(o, dict) or type(o.get("step")) is not int:
            refused[str(r)] = str(o.get("why")) if isinstance(o, dict) else "no live state offered"
    if refused:
        return {"live": None, "live_refused": refused}
    steps = {o["step"] for o in offers}
    seqs = {o.get("seq") for o in offers}
    if len(steps) > 1:  # (a peer completed the step this rank faulted in)
        return {"live": None, "live_refused": {str(r): f"at step {o['step']}" for r, o in enumerate(offers)}}
    if len(seqs) > 1:  # (the same step, other collectives: a desync the live state would carry on)
        why = {str(r): f"{o.get('seq')} collectives issued" for r, o in enumerate(offers)}
        return {"live": None, "live_refused": why}
    (step,) = steps
    if ring_step is not None and step < ring_step:  # (never: a snapshot is of a completed step)
        return {"live": None, "live_refused": {"all": f"step {step} is behind the snapshot of {ring_step}"}}
    found, refused = donors(offers)  # (a replacement's large state: a survivor's equal copy)
    if refused:
        return {"live": None, "live_refused": refused}
    return {"live": step, **({"live_donors": found} if found else {})}


def donors(offers: list[Any]) -> tuple[dict[str, int], dict[str, str]]:
    """For each replacement's offer (``mirrored``), the lowest survivor whose posted fingerprints
    of a common snapshot step equal its predecessor's, at a step after that survivor's state was
    last set from elsewhere; and why not, by rank, for those that have none."""
    found: dict[str, int] = {}
    refused: dict[str, str] = {}
    for r, o in enumerate(offers):
        if not isinstance(o, dict) or not isinstance(o.get("mirrored"), dict):
            continue
        want = o["mirrored"].get("prints") or {}
        for q, v in enumerate(offers):
            vouch = v.get("vouch") if isinstance(v, dict) else None
            if not isinstance(vouch, dict) or not isinstance(vouch.get("since"), int):
                continue
            have = vouch.get("prints") or {}
            if any(int(k) > vouch["since"] and have.get(k) == p for k, p in want.items()):
                found[str(r)] = q
                break
        else:
            steps = sorted(want, key=int)
            refused[str(r)] = (
                f"no survivor posted fingerprints equal to its predecessor's (snapshot steps {steps}) "
                "at a step after its state was set: not a replica"
            )
    return found, refused


def ring_plan(offers: list[Any], steps: list[int]) -> dict[str, Any]:
    """The newest of ``steps`` (held by every rank, newest first) at which each replacement from
    another node has its large objects from a survivor's equal copy (:func:`stored_donors`) or
    from its predecessor's buddy copy (:func:`buddies`); where none has, the newest step's
    refusals. Without such replacements: the newest step."""
    first: dict[str, Any] | None = None
    for step in steps:
        found, refused = stored_donors(offers, step)
        held = buddies(offers, step, list(refused))
        left = {r: f"{why}; nor its buddy copy" for r, why in refused.items() if r not in held}
        names = {r: sorted(offers[int(r)]["stored"][str(step)]) for r in found}
        plan = {
            "step": step,
            "ring_donors": found or None,
            "ring_names": names or None,
            "ring_buddies": held or None,
            "ring_refused": left or None,
        }
        if not left:
            return plan
        first = first or plan
    return first or {}


def buddies(offers: list[Any], step: int, ranks: list[str]) -> dict[str, int]:
    """For each of ``ranks`` (replacements with no replica) whose predecessor posted a store copy
    of ``step``, the lowest other rank offering its buddy copy of that step."""
    found: dict[str, int] = {}
    for r in ranks:
        stored = offers[int(r)].get("stored") if isinstance(offers[int(r)], dict) else None
        if not isinstance(stored, dict) or not isinstance(stored.get(str(step)), dict):
            continue  # (no fingerprints to check a copy against, nor its small objects)
        for q, o in enumerate(offers):
            held = o.get("buddy") if isinstance(o, dict) and q != int(r) else None
            if isinstance(held, dict) and isinstance(held.get(r), list) and step in held[r]:
                found[r] = q
                break
    return found


def stored_donors(offers: list[Any], step: int) -> tuple[dict[str, int], dict[str, str]]:
    """For each replacement restoring ``step`` from its predecessor's store copy (``stored``), the
    lowest survivor whose posted fingerprints of ``step`` equal every one the predecessor posted
    for objects too large for the store, at a step after that survivor's state was last set from
    elsewhere; and why not, by rank, for those that need one and have none."""
    found: dict[str, int] = {}
    refused: dict[str, str] = {}
    for r, o in enumerate(offers):
        stored = o.get("stored") if isinstance(o, dict) else None
        if not isinstance(stored, dict):
            continue
        want = stored.get(str(step))
        if not isinstance(want, dict):
            refused[str(r)] = f"its predecessor posted no store copy of step {step}"
            continue
        if not want:
            continue  # (every object of it fits the store copy: nothing to take from a peer)
        for q, v in enumerate(offers):
            vouch = v.get("vouch") if isinstance(v, dict) else None
            if (
                not isinstance(vouch, dict)
                or not isinstance(vouch.get("since"), int)
                or step <= vouch["since"]
            ):
                continue
            have = (vouch.get("prints") or {}).get(str(step)) or {}
            if all(have.get(n) == p for n, p in want.items()):
                found[str(r)] = q
                break
        else:
            refused[str(r)] = (
                f"no survivor posted fingerprints of step {step} equal to its predecessor's "
                f"({sorted(want)}): no replica holds its state"
            )
    return found, refused


REDUCE: dict[str, Callable[[list[str]], str]] = {
    "any": lambda vs: "1" if any(v == "1" for v in vs) else "0",
    "all": lambda vs: "1" if all(v == "1" for v in vs) else "0",
    "first": lambda vs: vs[0],  # rank 0's
    "same": lambda vs: "1" if len(set(vs)) <= 1 else "0",
}


def common_restore_step(steps_by_rank: Sequence[Sequence[int]], primary: FaultRecord | None = None) -> int:
    """The newest snapshot step every rank holds. A rank holding none failed before its first
    step: :class:`SetupFailed`, naming it (and the fault, when it is that rank's)."""
    plan = RestorePlan.parse(restore_plan([json.dumps(list(s)) for s in steps_by_rank]))
    return plan.snapshot_step(primary)


def all_hold(store: dist.Store, base: str, world_size: int, value: str, timeout: float) -> bool:
    """Whether every rank holds ``value``: each counts itself under its value, then under the
    arrivals; the last to arrive releases the others. A few store calls per rank at any size."""
    mine = f"{base}/v/{value or '-'}"
    store.add(mine, 1)  # before the arrival: once all arrived, every count is final
    if store.add(f"{base}/n", 1) == world_size:
        store.set(f"{base}/done", "1")
    store.wait([f"{base}/done"], timedelta(seconds=timeout))
    return store.add(mine, 0) == world_size
