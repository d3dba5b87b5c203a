"""Typed errors and process exit codes.

Every error the library raises derives from :class:`ResilienceError`, so a caller can
catch "anything resilient decided" with one clause. The exit codes are the contract with
the launcher (and with Slurm/Kubernetes): they say whether relaunching can help.
"""

from __future__ import annotations

import enum
from typing import ClassVar


class ExitCode(enum.IntEnum):
    """Process exit codes a rank ends with when it cannot continue in-process.

    - ``SUCCESS``: the training function returned on every rank.
    - ``FATAL``: retrying will not help (restart budget exhausted, a fault that repeats at the
      same step, a configuration error, an error before the first step). A launcher must not
      relaunch; a scheduler must not requeue.
    - ``HARD_FAULT``: this process cannot recover in place (failed health check, a peer that never
      came back, a sticky CUDA error). A launcher should relaunch the worker group.
    - ``REQUEUE``: the job was asked to stop (preemption); requeue it.

    A hang that holds the GIL cannot be reached by Python at all; the runtime arms an interval
    timer whose ``SIGALRM`` kills the process after dumping every thread's stack, so such a rank
    ends *by signal* ``SIGALRM`` (shell status 142), which the launcher reads as a hard hang.
    """

    SUCCESS = 0
    FATAL = 3
    HARD_FAULT = 75
    REQUEUE = 76


class ResilienceError(Exception):
    """Root of every error raised by resilient. A fault a detector raises names, in class
    attributes, how a fault record calls it (``symptom``; None: classified like any exception),
    whether it is recovered in-process (``severity``) and, where its message varies from run to
    run, the signature repeats are compared by (``signature_text``), and what the rest of the
    house does with it: a step rolled back (``rolls_back``: goodput's ``rollback`` cause), a live
    state not trusted after it (``doubts_state``: why), a peer allowed to finish its step's tail
    first (``peers_finish_step``)."""

    symptom: ClassVar[str | None] = None
    severity: ClassVar[str] = "soft"
    signature_text: ClassVar[str | None] = None
    rolls_back: ClassVar[bool] = False
    doubts_state: ClassVar[str | None] = None
    peers_finish_step: ClassVar[bool] = False


class ConfigError(ResilienceError):
    """A configuration value is invalid; the message names the field, the value and the source."""


class SoftFault(ResilienceError):
    """A fault the runtime itself detected inside a step and recovers from in-process."""


class SnapshotError(SoftFault):
    """Copying a tracked object's state failed; the message names the object and the leaf."""


class HardFault(ResilienceError):
    """A fault that in-process recovery cannot fix; the process should exit for the launcher."""

    exit_code = ExitCode.HARD_FAULT
    severity: ClassVar[str] = "hard"


class CoordinationError(HardFault):
    """The ranks could not agree (a peer never arrived at a barrier, the store is gone).

    A hard fault: a relaunch of the worker group (fresh processes, fresh rendezvous) can help.
    """


class HealthCheckFailed(HardFault):
    """A health check failed between detection and rebuild."""

    def __init__(self, check: str, value: object, detail: str) -> None:
        super().__init__(f"health check {check!r} failed: {detail} (value: {value})")
        self.check = check
        self.value = value
        self.detail = detail


class PeerAborted(HardFault):
    """Another rank gave up (for example its health check failed), so this generation cannot form."""


class RestartBudgetExhausted(ResilienceError):
    """More restarts than the policy allows; training stops with a diagnosis instead of looping."""

    exit_code = ExitCode.FATAL

    def __init__(self, message: str, history: list[dict[str, object]] | None = None) -> None:
        super().__init__(message)
        self.history = history or []


class FaultRepeats(RestartBudgetExhausted):
    """The same fault happened at the same step too many times in a row."""

    def __init__(self, step: int, signature: str, count: int, history: list[dict[str, object]]) -> None:
        super().__init__(f"fault repeats at step {step}: {signature} ({count} times in a row)", history)
        self.step = step
        self.signature = signature
        self.count = count


class SetupFailed(ResilienceError):
    """A rank failed before its first snapshot (importing, building the model, ``ctx.track``,
    ``ctx.steps``): there is no state to go back to and the same code would fail again. The rank
    that raised ends with its own exception; its peers end with this one, which names it."""

    exit_code = ExitCode.FATAL

    def __init__(self, message: str, ranks: list[int] | None = None) -> None:
        super().__init__(message)  # (rebuilt from its message alone by frameworks that copy errors)
        self.ranks = ranks or []  # the ranks that held no snapshot


class StateRestoreError(ResilienceError):
    """The tracked state could not be restored (no snapshot every rank holds, a shape mismatch)."""


class CheckpointError(ResilienceError):
    """A checkpoint could not be written or read."""


class NoValidCheckpoint(CheckpointError):
    """Checkpoints exist but none verifies on every rank. A relaunch reads the same bytes, so it is
    fatal for the launcher; the message names every checkpoint tried and why it failed."""

    exit_code = ExitCode.FATAL

    def __init__(self, message: str, tried: list[str] | None = None, steps: list[int] | None = None) -> None:
        super().__init__(message)
        self.tried = tried or []  # "step-N: why", newest first
        self.steps = steps or []  # the steps that failed


class ReplayDiverged(ResilienceError):
    """``verify_replay: stop``: a step replayed after a restore differs from the step it replays
    (the message names the step, the objects and the likely causes). Replaying again would not
    make it equal, so it is fatal."""

    exit_code = ExitCode.FATAL


class Preempted(ResilienceError):
    """A preemption signal arrived; the final checkpoint is committed. Exit so the job is requeued."""

    exit_code = ExitCode.REQUEUE

    def __init__(self, message: str, step: int | None = None) -> None:
        super().__init__(message)
        self.step = step


class StepInterrupted(BaseException):
    """Raised in the main thread to pull it out of a step (a hang, or a fault on another rank).

    It derives from ``BaseException`` on purpose, like ``KeyboardInterrupt``: user code that
    catches ``Exception`` around its step must not swallow the runtime's interrupt.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
