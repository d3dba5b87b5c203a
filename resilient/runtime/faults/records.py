"""Fault records: classification of an exception into a fault kind, and a stable signature.

The signature is what repeat-detection compares: the kind, the exception type and the message
with volatile parts (numbers, addresses, ports, paths' digits) removed, so the same bug hitting
the same step twice yields the same signature even if a port or a pointer changed.
"""

from __future__ import annotations

import enum
import json
import math
import re
import time
from dataclasses import asdict, dataclass, field, fields

import torch

from resilient import contract
from resilient.detectors import REGISTRY as DETECTORS
from resilient.detectors.collectives import DESYNC, CollectiveDesync
from resilient.errors import ResilienceError, StepInterrupted


class Symptom(str, enum.Enum):
    """What the runtime saw of a fault (a record's ``kind``); the harness's fault *kinds* (what
    chaos injects, ``chaos.faults``) are another thing. These are the runtime's own; each detector
    names those of its faults (``resilient.detectors``: desync, nonfinite, spike, sdc), and a
    record's kind is one of either (:data:`KINDS`)."""

    EXCEPTION = "exception"  # an exception in user code
    OOM = "oom"  # torch.OutOfMemoryError / CUDA or host allocation failure raised as an exception
    COLLECTIVE = "collective"  # a collective failed: timeout, peer closed the connection, NCCL error
    HANG = "hang"  # no step progress for hang_timeout
    PEER = "peer"  # this rank was pulled out because another rank faulted
    PREEMPT = "preempt"  # a preemption signal: save a final checkpoint and exit for requeue
    CUDA = "cuda"  # a sticky CUDA error: the context is unusable, in-process recovery is impossible
    DIED = contract.DIED  # a rank's process died (posted by the launcher's agent, which replaces it)
    MALFORMED = "malformed"  # a record a peer left in the store does not parse (reported, recovered)


class Severity(str, enum.Enum):
    SOFT = contract.SOFT  # recover in-process
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


def _dist_errors() -> tuple[type[BaseException], ...]:
    names = ("DistBackendError", "DistNetworkError", "DistStoreError", "DistError")
    return tuple(getattr(torch.distributed, n) for n in names if hasattr(torch.distributed, n))


def kinds() -> frozenset[str]:
    """Every kind a fault record may have: the runtime's symptoms and the detectors'."""
    return frozenset(k.value for k in Symptom) | DETECTORS.symptoms()


def _fixed(kind: str) -> str | None:
    """A detector symptom's signature where its message varies run to run (a desync's counts)."""
    texts = (f.signature_text for f in DETECTORS.faults() if f.symptom == kind and f.signature_text)
    return next(texts, None)


def decisive(exc: BaseException) -> BaseException:
    """The exception that says what ``exc`` is: itself, or the first of the errors it was raised
    from (``raise ... from e``) that classifies as more than a plain exception. Frameworks wrap
    what a step raised (torch.distributed.pipelining: ``RuntimeError("... failed to run
    forward") from e``): an OOM or a detector's fault stays what it is."""
    seen, e = 0, exc  # type: tuple[int, BaseException | None]
    while e is not None and seen < 8:
        if _classify_one(e)[0] != Symptom.EXCEPTION:
            return e
        e, seen = e.__cause__, seen + 1
    return exc


def classify(exc: BaseException) -> tuple[str, Severity]:
    """Map an exception to (kind, severity): a detector's fault by what its class says, the rest
    by its type and message, looking through the errors it was raised from (:func:`decisive`).
    Unknown exceptions are soft: retrying is bounded."""
    return _classify_one(decisive(exc))


def _classify_one(exc: BaseException) -> tuple[str, Severity]:
    msg = str(exc)
    if isinstance(exc, StepInterrupted):
        if exc.reason.startswith("preempt"):
            return Symptom.PREEMPT, Severity.SOFT
        if exc.reason.startswith(DESYNC):  # (the hang monitor's diagnosis of a skipped collective)
            return DESYNC, Severity.SOFT
        return (Symptom.HANG if exc.reason.startswith("hang") else Symptom.PEER), Severity.SOFT
    if isinstance(exc, ResilienceError) and exc.symptom is not None:
        return exc.symptom, Severity(exc.severity)
    if isinstance(exc, torch.OutOfMemoryError | MemoryError) or _OOM_PATTERNS.search(msg):
        return Symptom.OOM, Severity.SOFT
    if _STICKY_CUDA.search(msg) and ("cuda" in msg.lower() or "device-side" in msg.lower()):
        return Symptom.CUDA, Severity.HARD
    if isinstance(exc, _dist_errors()) or _COLLECTIVE_PATTERNS.search(msg):
        return Symptom.COLLECTIVE, Severity.SOFT
    return Symptom.EXCEPTION, Severity.SOFT


def signature(kind: str, exc: BaseException) -> str:
    """A stable, human-readable signature: kind, type and normalized first line of the message
    (or the fixed text of a fault whose message varies from run to run)."""
    kind = kind.value if isinstance(kind, Symptom) else kind
    fixed = exc.signature_text if isinstance(exc, ResilienceError) else _fixed(kind)
    if fixed is not None:
        return fixed
    first = contract.stable_line(str(exc))
    if kind in (Symptom.HANG, Symptom.PEER, Symptom.DIED):
        return f"{kind}: {first}"
    return f"{kind}: {type(exc).__name__}: {first}"


def _cause(exc: BaseException) -> str:
    """`` (from OutOfMemoryError: ...)`` where another exception decided what ``exc`` is."""
    d = decisive(exc)
    return "" if d is exc else f" (from {type(d).__name__}: {str(d)[:300]})"


def _window_start(exc: BaseException) -> int | None:
    """The first step a silent fault's check window covered (detectors/collectives.py,
    replicas.py), or None for a fault of one step."""
    start = getattr(exc, "window_start", None)
    return start if type(start) is int and start >= 0 else None


class MalformedRecord(ValueError):
    """A record read from the store is not one this runtime writes."""


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
    # a silent fault found at a check window's end: the window's first step, the last whose start
    # was found good (state after it may be the fault's); None: the fault is its step's alone
    since: int | None = None

    @classmethod
    def from_exception(
        cls, exc: BaseException, *, rank: int, generation: int, step: int | None
    ) -> FaultRecord:
        kind, sev = classify(exc)
        return cls(
            rank=rank,
            generation=generation,
            step=step,
            kind=kind.value if isinstance(kind, Symptom) else kind,
            severity=sev.value,
            signature=signature(kind, decisive(exc)),
            message=f"{type(exc).__name__}: {str(exc)[:500]}" + _cause(exc),
            since=_window_start(decisive(exc)),
        )

    @classmethod
    def hang(
        cls, *, rank: int, generation: int, step: int | None, idle_s: float, limit_s: float, where: str
    ) -> FaultRecord:
        """A rank that completed no step for ``limit_s`` (the monitor's, or NVRx's soft timeout's)."""
        return cls(
            rank=rank,
            generation=generation,
            step=step,
            kind=Symptom.HANG.value,
            severity=Severity.SOFT.value,
            signature="hang: no step progress",
            message=f"no step progress for {idle_s:.2f}s (limit {limit_s:g}s); main thread at {where}",
            latency_s=idle_s,
        )

    @classmethod
    def desync(
        cls,
        *,
        rank: int,
        generation: int,
        step: int | None,
        message: str,
        since: int | None,
        idle_s: float = 0.0,
    ) -> FaultRecord:
        """A rank waiting in a collective its neighbour's step lacked (the collective count's
        diagnosis); ``since``: the count window's first step."""
        return cls(
            rank=rank,
            generation=generation,
            step=step,
            kind=DESYNC,
            severity=Severity.SOFT.value,
            signature=CollectiveDesync.signature_text,
            message=message,
            latency_s=idle_s,
            since=since,
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str) -> FaultRecord:
        """A record as a peer posted it, checked field by field (:class:`MalformedRecord` if not)."""
        try:
            d = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise MalformedRecord(f"not JSON ({e})") from None
        if not isinstance(d, dict):
            raise MalformedRecord(f"a {type(d).__name__}, not a record")
        missing = [
            f for f in ("rank", "generation", "kind", "severity", "signature", "message") if f not in d
        ]
        extra = sorted(set(d) - {f.name for f in fields(cls)})
        if missing or extra:
            raise MalformedRecord(f"fields missing {missing}, unknown {extra}")

        def whole(name: str, low: int, none: bool = False) -> None:
            v = d.get(name)
            if not ((none and v is None) or (type(v) is int and v >= low)):
                raise MalformedRecord(f"{name}={v!r}")

        whole("rank", -1)
        whole("generation", 0)
        whole("step", 0, none=True)
        whole("since", 0, none=True)
        if d["kind"] not in kinds() or d["severity"] not in {s.value for s in Severity}:
            raise MalformedRecord(f"kind={d['kind']!r}, severity={d['severity']!r}")
        for name in ("signature", "message"):
            if not isinstance(d[name], str):
                raise MalformedRecord(f"{name}={d[name]!r}")
        for name in ("ts", "latency_s"):
            if name in d and (type(d[name]) not in (int, float) or not math.isfinite(d[name])):
                raise MalformedRecord(f"{name}={d[name]!r}")
        return cls(**{**d, "signature": d["signature"][:500], "message": d["message"][:2000]})

    @classmethod
    def parse(cls, raw: bytes | str, generation: int) -> FaultRecord:
        """The record, or, where it does not parse, a fault of its own (kind ``malformed``) that
        every rank recovers from alike, naming what was wrong; a peer's garbage never stops a
        listener."""
        try:
            return cls.from_json(raw)
        except MalformedRecord as e:
            text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
            return cls(
                rank=-1,
                generation=generation,
                step=None,
                kind=Symptom.MALFORMED.value,
                severity=Severity.SOFT.value,
                signature="malformed: a fault record in the store does not parse",
                message=f"malformed fault record ({e}): {text[:200]!r}",
            )
