"""What a detector is, and the registry that lists them.

A detector turns a fault that raises nothing (a NaN about to reach the weights, replicas that
differ, a rank that skipped a collective, a slow rank) into one the runtime recovers from. Each is
one class in one file of this package, listed in :data:`resilient.detectors.REGISTRY`; the class
says, in class attributes, everything the rest of the house needs:

- its configuration section (``section``: the key in the config; ``config``: the section's model,
  defined next to it), which :class:`resilient.config.Config` takes from the registry;
- the faults it raises (``faults``: exception classes, each naming its ``symptom`` and
  ``severity``), which the runtime's classification and the fault records take from the registry;
- the events that are its evidence (``evidence``) and a line for the docs (``summary``).

The runtime builds one per run (:meth:`Detector.build`, from its section and the :class:`Run` it
is part of) and calls its hooks at fixed points of the step loop and of the recovery; every hook
is optional. A detector that must look at what is *kept* (the collective count and the replica
digests, which ride one window of posts) is reached by its class (:meth:`Detectors.get`) where the
step loop keeps state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, ClassVar, Protocol, TypeVar

from pydantic.fields import FieldInfo

from resilient.errors import ResilienceError
from resilient.events import Event
from resilient.identity import Identity


class Emits(Protocol):
    def emit(self, event: Event, *, generation: int, step: int | None, **fields: Any) -> Any: ...


class Run(Identity, Protocol):
    """What a detector may reach of the run it is part of (the step loop gives it): who this rank
    is (:class:`~resilient.identity.Identity`), and the following."""

    @property
    def step(self) -> int | None:
        """The step being run (None before the first)."""
        ...

    @property
    def events(self) -> Emits: ...

    def where(self) -> str | None:
        """The batch being run, where a data position is known (``epoch 2, batch 17 of 'loader'``)."""
        ...

    def mark_replace(self, detail: dict[str, Any]) -> bool:
        """Under ``resilient launch``: ask this rank's agent to replace its process (True when asked)."""
        ...


class AgreedFault(Protocol):
    """The fault every rank agreed ended a generation (a :class:`~resilient.runtime.leave.
    faults.FaultRecord`), as the recovery tells the detectors."""

    kind: str
    severity: str
    step: int | None
    message: str


class Detector:
    """One detector (see the module docstring): subclasses set the class attributes and override
    the hooks they need; :meth:`build` makes the one of a run, or None where it is off."""

    name: ClassVar[str]
    summary: ClassVar[str]  # what it catches, in a line (docs/recovery.md's table of detectors)
    section: ClassVar[str]  # its key in the config
    config: ClassVar[Any]  # the section's type: a Section model (or a plain bool)
    config_default: ClassVar[Any] = None  # (a plain section's default; a model's is its defaults)
    config_description: ClassVar[str] = ""
    faults: ClassVar[tuple[type[ResilienceError], ...]] = ()  # each with ``symptom`` and ``severity``
    evidence: ClassVar[tuple[Event, ...]] = ()  # the events it writes beyond fault_detected

    @classmethod
    def field(cls) -> tuple[Any, FieldInfo]:
        """Its section as a field of the config model: (annotation, field)."""
        if cls.config_default is not None:
            return cls.config, FieldInfo(default=cls.config_default, description=cls.config_description)
        return cls.config, FieldInfo(default_factory=cls.config, description=cls.config_description)

    @classmethod
    def section_of(cls, cfg: Any) -> Any:
        """Its section of a loaded config (the defaults where the config has none: a detector
        added to a registry after the config model was made)."""
        got = getattr(cfg, cls.section, None)
        if got is not None:
            return got
        return cls.config_default if cls.config_default is not None else cls.config()

    @classmethod
    def build(cls, section: Any, run: Run) -> Detector | None:
        """The detector of ``run``, configured by ``section``; None where it is off."""
        raise NotImplementedError

    # -- the hooks (all optional) ---------------------------------------------------------------------
    def install(self) -> None:
        """Before the run's first generation: what it watches for the whole run (a patch)."""

    def uninstall(self) -> None:
        """The run is over: what :meth:`install` did is undone (every step runs)."""

    def generation(self, number: int) -> None:
        """Generation ``number`` begins: the objects the function tracks are tracked afresh."""

    def tracked(self, name: str, obj: Any) -> None:
        """The function tracked ``obj`` as ``name`` in this generation."""

    def step_begins(self, step: int) -> None: ...

    def step_done(self, step: int) -> None: ...

    def observed(self, loss: Any) -> None:
        """``ctx.observe(loss=...)``: the loss of the step being run (a tensor or a number),
        before the step is applied; raising one of :attr:`faults` here rolls the step back."""

    def restored(self, step: int) -> None:
        """The state of ``step`` was restored: what was seen of the steps after it is replayed."""

    def recovering(self, fault: AgreedFault, history: list[dict[str, object]]) -> None:
        """In the recovery, before the restart policy's verdict: the fault every rank agreed on
        (the same on every rank, so a verdict taken here is taken alike everywhere)."""


D = TypeVar("D", bound=Detector)


class DetectorRegistry(Mapping[str, type[Detector]]):
    """Every detector class, by name, in the order they were registered."""

    def __init__(self, detectors: Iterable[type[Detector]]) -> None:
        self._by_name: dict[str, type[Detector]] = {}
        sections: set[str] = set()
        for d in detectors:
            if d.name in self._by_name or d.section in sections:
                raise ValueError(f"detector {d.name!r} (section {d.section!r}) registered twice")
            self._by_name[d.name] = d
            sections.add(d.section)

    def __getitem__(self, name: str) -> type[Detector]:
        return self._by_name[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name)

    def __len__(self) -> int:
        return len(self._by_name)

    # one registry is one object (a default of frozen dataclasses), not a value compared by content
    __hash__ = object.__hash__

    def __eq__(self, other: object) -> bool:
        return self is other

    def fields(self) -> dict[str, tuple[Any, FieldInfo]]:
        """Every detector's config section, by its key: the config model's fields."""
        return {d.section: d.field() for d in self._by_name.values()}

    def faults(self) -> tuple[type[ResilienceError], ...]:
        """Every fault class a detector raises."""
        return tuple(f for d in self._by_name.values() for f in d.faults)

    def symptoms(self, where: Callable[[type[ResilienceError]], bool] = lambda f: True) -> frozenset[str]:
        """What the detectors' faults are called in a fault record (its ``kind``): those ``where``
        holds of (``lambda f: f.rolls_back``: the faults whose step is rolled back)."""
        return frozenset(f.symptom for f in self.faults() if f.symptom is not None and where(f))

    def doubts(self) -> dict[str, str]:
        """The symptoms after which the live state is not trusted, and why (runtime/steps/live.py)."""
        return {f.symptom: f.doubts_state for f in self.faults() if f.symptom and f.doubts_state}

    def evidenced_by(self, event: Event) -> frozenset[str]:
        """The symptoms of the detectors that write ``event`` as their evidence."""
        return frozenset(
            f.symptom for d in self._by_name.values() if event in d.evidence for f in d.faults if f.symptom
        )


class Detectors:
    """The detectors of one run: those of the registry that are on, the hooks fanned out to each."""

    def __init__(self, detectors: Iterable[Detector]) -> None:
        self.all = list(detectors)

    @classmethod
    def build(cls, registry: DetectorRegistry, cfg: Any, run: Run) -> Detectors:
        built = (d.build(d.section_of(cfg), run) for d in registry.values())
        return cls(d for d in built if d is not None)

    def get(self, kind: type[D]) -> D | None:
        """The run's detector of class ``kind``, if it is on."""
        return next((d for d in self.all if isinstance(d, kind)), None)

    def each(self, hook: Callable[[Detector], None]) -> None:
        for d in self.all:
            hook(d)

    def uninstall(self) -> None:
        """Every detector's :meth:`Detector.uninstall`, even when one fails (the first error raised)."""
        errors = []
        for d in self.all:
            try:
                d.uninstall()
            except Exception as e:
                errors.append(e)
        if errors:
            raise errors[0]
