"""What a recovery decides, apart from what it does: pure functions of the agreed fault, this
rank's own record of it, the restart policy and the recovery barrier's plan. Every rank decides
from the same primary fault and the same plan, so every rank decides alike; a test decides with
fakes in milliseconds (``tests/unit/test_recovery_decision.py``). The phases that act on a
decision are :class:`~resilient.runtime.recovery.recovery.Recovery`'s."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from resilient.detectors.replicas import SDC
from resilient.errors import (
    HardFault,
    RestartBudgetExhausted,
    SetupFailed,
    StateRestoreError,
    StepInterrupted,
)
from resilient.runtime.faults.exits import raised_as_itself
from resilient.runtime.faults.records import FaultRecord, Severity, Symptom


class Verdict(str, enum.Enum):
    """The admit phase's outcome."""

    RESTART = "restart"  # recover in-process: the next generation resumes from the agreed restore
    HARD = "hard"  # this rank's own fault left its process unusable (a sticky CUDA error)
    PREEMPT = "preempt"  # save a final checkpoint, then exit for requeue
    GIVE_UP = "give_up"  # the restart policy refused: its budget is spent, or the fault repeats


@dataclass(frozen=True)
class Admission:
    verdict: Verdict
    delay_s: float = 0.0  # RESTART: the backoff before the next generation
    attribute: bool = False  # RESTART: replicas differed; the corrupt one is named before the agreement
    refusal: RestartBudgetExhausted | None = None  # GIVE_UP: the policy's reason, typed


class Policy(Protocol):
    """The restart policy as the decision sees it (``recovery/policy.py``'s :class:`RestartPolicy`)."""

    history: list[FaultRecord]

    def admit(self, fault: FaultRecord) -> float: ...


# a detector's verdict on a fault that comes back on replay (``Detector.recovering``): it raises
# the refusal, taken from the agreed fault so that every rank takes the same
Recovering = Callable[[FaultRecord, list[dict[str, Any]]], None]


def admit(primary: FaultRecord, own: FaultRecord | None, policy: Policy, recovering: Recovering) -> Admission:
    """Whether the run recovers from ``primary`` (the generation's first posted fault; ``own``:
    this rank's record, when the fault was its own exception), and how."""
    if own is not None and own.severity == Severity.HARD.value:
        return Admission(Verdict.HARD)
    if primary.kind == Symptom.PREEMPT.value:
        return Admission(Verdict.PREEMPT)
    try:
        recovering(primary, [asdict(f) for f in [*policy.history, primary]])
        delay = policy.admit(primary)
    except RestartBudgetExhausted as e:
        return Admission(Verdict.GIVE_UP, refusal=e)
    silent = primary.kind == SDC and primary.severity == Severity.SOFT.value
    return Admission(Verdict.RESTART, delay_s=delay, attribute=silent)


def failed_agreement(
    error: SetupFailed | StateRestoreError, own: BaseException | None, rank: int, under_launcher: bool
) -> BaseException:
    """What this rank raises when the recovery barrier's plan has no step to restore (``own``:
    the exception this rank's step raised, if any):

    - ranks that failed before their first step hold nothing: the culprit raises its own
      exception as itself, every other rank the :class:`SetupFailed` that names it;
    - no step every rank holds: under ``resilient launch`` the whole group restarts (and resumes
      from shared memory or a checkpoint), else the run ends with the error."""
    if isinstance(error, SetupFailed):
        if own is None or rank not in error.ranks or isinstance(own, StepInterrupted):
            return error
        return raised_as_itself(own, rank)
    if not under_launcher:
        return error
    hard = HardFault(f"rank {rank}: {error}; the launcher restarts the group")
    hard.__cause__ = error
    return hard
