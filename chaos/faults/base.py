"""What a fault kind is: one small object that says where it fires, what it needs, how it is
arranged, fired and proved. Every kind lives in :data:`chaos.faults.REGISTRY`; ``certify``, ``run``,
``stream`` and the injector ask the registry, never compare kind names.

A kind fires in one of two places:

- **in-process** (:attr:`Where.STEP`, :attr:`Where.BEFORE_COLLECTIVE`): inside the training process,
  at the start of the step, by the harness's step hook (``CHAOS_PLAN``, chaos/hooks.py) through
  :meth:`FaultKind.inject`;
- **by the harness** (:attr:`Where.HARNESS`): to the rank's process, when the event log shows the
  rank reached the step, through :meth:`FaultKind.by_harness`.

An in-process kind may have a harness part too (``kernel_oom``: the rank is moved into a memory
cgroup a few steps before it allocates): it sets :attr:`FaultKind.harness_lead`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from resilient.events import Event

if TYPE_CHECKING:
    from chaos.inject import Fault
    from chaos.netns import VethLink
    from chaos.runner import Runner
    from chaos.schedule import Planned

# Undoes a one-step change (desync, a hook on the model) once its step is over, and says whether
# the fault acted in that step: why it did not (the collective it skips was never issued, the
# gradient it poisons never flowed), or None. The injector records the reason; the certificate
# then skips the trial, naming it, rather than failing a detector that had nothing to detect.
Undo = Callable[[], str | None]


class InjectedFault(Exception):
    """The exception a chaos injector raises; its message names the injection."""


class Where(str, enum.Enum):
    """Where a kind fires (``str`` values: the injector's ``where``)."""

    STEP = "step"  # in-process, at the start of the step
    BEFORE_COLLECTIVE = "before_collective"  # in-process, before the step's first collective
    HARNESS = "harness"  # by the harness, to the rank's process, once it reached the step

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Evidence:
    """Which events prove a fault was detected, and whether a recovery follows it."""

    name: str  # as the docs' table shows it
    detection: tuple[Event, ...]  # the first of these after the injection is its detection
    restarts: bool  # True: recovered once every rank completed a step in a new generation or process


# a crash of any kind: the runtime's, the launcher's, the checkpoint reader's detection events
CRASH = Evidence(
    "fault",
    (Event.FAULT_DETECTED, Event.WORKER_DIED, Event.HEARTBEAT_MISSED, Event.CHECKPOINT_REJECTED),
    True,
)
# a slow disk is no crash: a save waiting on it shows, nothing restarts, there is no recovery to time
SLOW_STORAGE = Evidence("slow save", (Event.CHECKPOINT_SLOW,), False)


@dataclass
class Arrangement:
    """What a job's planned faults need, made before the job starts; ``stack`` removes it all when
    the job is over, even when it failed."""

    stack: ExitStack
    link: VethLink | None = None  # the veth link one rank runs behind (link faults)
    memcg: Path | None = None  # the memory cgroup a rank is moved into (kernel_oom)
    cpucg: Path | None = None  # the cpu cgroup a rank is throttled in (straggler)


class FaultKind:
    """One kind of fault. Subclasses set the class attributes and implement :meth:`inject` (an
    in-process kind) or :meth:`by_harness` (a harness kind); the rest has defaults."""

    name: ClassVar[str]
    summary: ClassVar[str]  # the fault, in a line (`chaos kinds`, docs/chaos.md)
    where: ClassVar[Where]
    needs: ClassVar[tuple[str, ...]] = ()  # capabilities; without one the fault is SKIPPED, never faked
    arg: ClassVar[str] = ""  # what ``kind@step=ARG`` means; "" takes none
    default_arg: ClassVar[float | None] = None  # written into plans the harness builds
    default_slo: ClassVar[Mapping[str, Any] | None] = None  # a class without ``slo:`` gets this
    streams: ClassVar[bool] = True  # can be one of many faults in a long job (``stream:``)
    evidence: ClassVar[Evidence] = CRASH
    lasting: ClassVar[str | None] = None  # a fault that lasts ``duration`` seconds: what lasts
    harness_lead: ClassVar[int | None] = None  # the harness acts once the rank completed step - lead
    breaks_checkpoint: ClassVar[bool] = False  # the checkpoint at the fault's step must not load
    on_link: ClassVar[bool] = False  # hits the rank behind the job's veth link (one rank per job)
    skip_label: ClassVar[str] = ""  # how a run of many faults names this one when it is skipped
    kills: ClassVar[bool] = False  # the rank's process does not survive it: a standby may take its place
    # can fire at a point of a recovery (``kind@point:rank``, runtime/hooks.py POINTS): the second
    # fault of a compound class, fired by the rank itself where the recovery reached
    in_recovery: ClassVar[bool] = False

    @property
    def in_process(self) -> bool:
        return self.where is not Where.HARNESS

    def label(self) -> str:
        return self.skip_label or self.name

    def check_arg(self, arg: float | None) -> str | None:
        """Why ``arg`` is unusable for this kind (a config error), or None."""
        return None

    def arrange(self, setup: Arrangement, faults: Sequence[Planned]) -> str | None:
        """Make what ``faults`` (all of this kind, one job) need, registering its removal on
        ``setup.stack``; return why it cannot be made here (the faults are then skipped)."""
        return None

    def inject(self, fault: Fault, objects: Iterable[object]) -> Undo | None:
        """Fire ``fault`` in this process (``objects``: the state the runtime tracks). A change that
        lasts the step returns its :data:`Undo`, which also says whether the fault acted."""
        raise TypeError(f"{self.name} is not fired in-process")

    def at_point(self, fault: Fault) -> None:
        """Fire ``fault`` in this process where a recovery reached its point (``in_recovery``)."""
        self.inject(fault, ())

    def by_harness(self, run: Runner, f: Planned, done: int, pid: int) -> float | None:
        """Do ``f`` to ``pid``, the rank's process, which completed step ``done``. Returns when a
        fault with a duration ended (``time.time()``), else None."""
        raise TypeError(f"{self.name} is not fired by the harness")


class InProcess(FaultKind):
    """A kind the step hook fires inside the training process, at the start of its step."""

    where: ClassVar[Where] = Where.STEP


class ByHarness(FaultKind):
    """A kind the harness does to the rank's process once the rank completed the step before."""

    where: ClassVar[Where] = Where.HARNESS
    harness_lead: ClassVar[int | None] = 1


class KindRegistry(Mapping[str, FaultKind]):
    """Every fault kind, by name, in the order they were registered."""

    def __init__(self, kinds: Iterable[FaultKind]) -> None:
        self._kinds: dict[str, FaultKind] = {}
        for k in kinds:
            if k.name in self._kinds:
                raise ValueError(f"fault kind {k.name!r} registered twice")
            self._kinds[k.name] = k

    def __getitem__(self, name: str) -> FaultKind:
        return self._kinds[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._kinds)

    def __len__(self) -> int:
        return len(self._kinds)

    def names(self, pred: Callable[[FaultKind], bool] = lambda k: True) -> tuple[str, ...]:
        return tuple(n for n, k in self._kinds.items() if pred(k))
