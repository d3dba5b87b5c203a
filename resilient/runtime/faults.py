"""Fault records: classification of an exception into a fault kind, and a stable signature.

The signature is what repeat-detection compares: the kind, the exception type and the message
with volatile parts (numbers, addresses, ports, paths' digits) removed, so the same bug hitting
the same step twice yields the same signature even if a port or a pointer changed.
"""

from __future__ import annotations

import enum
import json
import re
import time
from dataclasses import asdict, dataclass, field

import torch

from resilient.errors import StepInterrupted
from resilient.runtime.collective_check import CollectiveDesync


class FaultKind(str, enum.Enum):
    EXCEPTION = "exception"  # an exception in user code
    OOM = "oom"  # torch.OutOfMemoryError / CUDA or host allocation failure raised as an exception
    COLLECTIVE = "collective"  # a collective failed: timeout, peer closed the connection, NCCL error
    HANG = "hang"  # no step progress for hang_timeout
    PEER = "peer"  # this rank was pulled out because another rank faulted
    PREEMPT = "preempt"  # a preemption signal: save a final checkpoint and exit for requeue
    CUDA = "cuda"  # a sticky CUDA error: the context is unusable, in-process recovery is impossible
    DESYNC = "desync"  # ranks issued different collectives in one step (runtime/collective_check.py)
    DIED = "died"  # a rank's process died (posted by the launcher's agent, which replaces it)


class Severity(str, enum.Enum):
    SOFT = "soft"  # recover in-process
    HARD = "hard"  # exit for the launcher


_COLLECTIVE_PATTERNS = re.compile(
    r"connection closed by peer|connection reset|broken pipe|timed out waiting|operation timed out|"
    r"nccl|gloo|process ?group|communicator|watchdog caught collective",
    re.IGNORECASE,
)
_OOM_PATTERNS = re.compile(
    r"out of memory|can(no|')t allocate memory|not enough memory|std::bad_alloc", re.IGNORECASE
)
_STICKY_CUDA = re.compile(
    r"illegal memory access|device-side assert|unspecified launch failure|uncorrectable ecc|"
    r"illegal instruction|misaligned address|cuda error: (?!out of memory)",
    re.IGNORECASE,
)
_VOLATILE = re.compile(r"0x[0-9a-fA-F]+|\[[0-9a-fA-F:.]+\]:\d+|\d+(\.\d+)?")


def _dist_errors() -> tuple[type[BaseException], ...]:
    names = ("DistBackendError", "DistNetworkError", "DistStoreError", "DistError")
    return tuple(getattr(torch.distributed, n) for n in names if hasattr(torch.distributed, n))


def classify(exc: BaseException) -> tuple[FaultKind, Severity]:
    """Map an exception to (kind, severity). Unknown exceptions are soft: retrying is bounded."""
    msg = str(exc)
    if isinstance(exc, StepInterrupted):
        if exc.reason.startswith("preempt"):
            return FaultKind.PREEMPT, Severity.SOFT
        if exc.reason.startswith("desync"):
            return FaultKind.DESYNC, Severity.SOFT
        return (FaultKind.HANG if exc.reason.startswith("hang") else FaultKind.PEER), Severity.SOFT
    if isinstance(exc, CollectiveDesync):
        return FaultKind.DESYNC, Severity.SOFT
    if isinstance(exc, torch.OutOfMemoryError | MemoryError) or _OOM_PATTERNS.search(msg):
        return FaultKind.OOM, Severity.SOFT
    if _STICKY_CUDA.search(msg) and ("cuda" in msg.lower() or "device-side" in msg.lower()):
        return FaultKind.CUDA, Severity.HARD
    if isinstance(exc, _dist_errors()) or _COLLECTIVE_PATTERNS.search(msg):
        return FaultKind.COLLECTIVE, Severity.SOFT
    return FaultKind.EXCEPTION, Severity.SOFT


def signature(kind: FaultKind, exc: BaseException) -> str:
    """A stable, human-readable signature: kind, type and normalized first line of the message."""
    first = (str(exc).strip().splitlines() or [""])[0]
    first = _VOLATILE.sub("N", first)[:160]
    if kind is FaultKind.DESYNC:  # the counts differ run to run; the place does not
        return "desync: ranks issued different collectives in a step"
    if kind in (FaultKind.HANG, FaultKind.PEER, FaultKind.DIED):
        return f"{kind.value}: {first}"
    return f"{kind.value}: {type(exc).__name__}: {first}"


@dataclass
class FaultRecord:
    """One rank's observation of a fault, posted to the store and written to the event log."""

    rank: int
    generation: int
    step: int | None
    kind: str
    severity: str
    signature: str
    message: str
    ts: float = field(default_factory=time.time)
    latency_s: float = 0.0  # fault start → detection, where known (a hang: the idle time)

    @classmethod
    def from_exception(
        cls, exc: BaseException, *, rank: int, generation: int, step: int | None
    ) -> FaultRecord:
        kind, sev = classify(exc)
        return cls(
            rank=rank,
            generation=generation,
            step=step,
            kind=kind.value,
            severity=sev.value,
            signature=signature(kind, exc),
            message=f"{type(exc).__name__}: {str(exc)[:500]}",
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str) -> FaultRecord:
        return cls(**json.loads(raw))
