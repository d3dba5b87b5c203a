"""Step hooks: code that plugs into the runtime at fixed points of a run, unknown to the runtime.

A hook sees the run start, the start and end of every step, and the run's end. The chaos harness
is one (it fires planned faults inside a step, logs every step for a certificate's timeline and
dumps the final state it compares bit for bit); a user's profiler or metrics exporter can be
another. Hooks come from three places:

- ``resilient.wrap(hooks=[...])``: objects the caller passes;
- the ``resilient.hooks`` entry-point group: each entry point names a factory ``() -> hook | None``
  that an installed package provides; ``None`` means "not active in this process";
- ``RESILIENT_HOOKS`` (:attr:`LaunchEnv.hooks`): comma-separated ``module:factory`` names, each a
  factory like an entry point's, loaded only in the processes whose environment names them (a
  chaos job's: ``chaos.hooks:from_env``, so a plain run never imports the harness).

An exception raised by ``before_step`` is a fault in that step (this is how a harness injects
one). ``on_phase`` is told where a recovery is (:data:`POINTS`); what it raises is raised there,
as if that phase had raised it (a harness injects a second fault inside a recovery this way: a
hook written for observing must not raise). The other methods must not raise.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from loguru import logger

from resilient.launch_env import LaunchEnv

if TYPE_CHECKING:
    from resilient.config import Config
    from resilient.events import EventLog

ENTRY_POINT_GROUP = "resilient.hooks"

# Where ``on_phase`` is called, in the order a recovery passes them: the built-in engine's
# recovery phases (runtime/recovery/recovery.py), the next generation's group built, the
# function re-entered, its first tracked object loaded, its first step begun; ``join``: a
# replacement (a promoted standby, a new process) about to join its dead predecessor's survivors;
# and ``commit``, outside a recovery: a checkpoint about to be committed (its manifest written,
# its directory renamed) by the rank that commits, in the thread that writes (resilient/points.py).
POINTS = ("join", "leave", "check", "agree", "rebuild", "reenter", "restore", "first_step", "commit")


@dataclass(frozen=True)
class RunInfo:
    """What a hook is told when the run starts."""

    rank: int
    world_size: int
    engine: str
    config: Config
    launch: LaunchEnv
    events: EventLog
    run_dir: Path


class Tracked(list[object]):
    """The objects a function tracks, in the order it tracked them, with their ``names``."""

    def __init__(self, objects: Sequence[object], names: Sequence[str]) -> None:
        super().__init__(objects)
        self.names = list(names)


@runtime_checkable
class StepHook(Protocol):
    def on_start(self, run: RunInfo) -> None: ...

    def before_step(self, step: int, objects: Sequence[object]) -> None:
        """At the start of ``step``, with the objects the function tracks (model, optimizer…): a
        list whose ``names`` are the names they were tracked under (:class:`Tracked`)."""

    def after_step(self, generation: int, step: int, step_s: float | None) -> None:
        """``step`` completed (``step_s``: since the previous one completed; None for the first).
        The next step's start is already captured for a live resume: a hook that changed
        tracked state or drew from an RNG here would not be undone by one (it observes)."""

    def on_finish(self, final_state: Callable[[], Mapping[str, Any]]) -> None:
        """The function returned on every rank; ``final_state()`` captures what it tracked."""


class Hook:
    """A :class:`StepHook` that does nothing: subclass it and override what you need."""

    def on_start(self, run: RunInfo) -> None:
        return None

    def before_step(self, step: int, objects: Sequence[object]) -> None:
        return None

    def after_step(self, generation: int, step: int, step_s: float | None) -> None:
        return None

    def on_finish(self, final_state: Callable[[], Mapping[str, Any]]) -> None:
        return None

    def on_phase(self, phase: str, generation: int, step: int | None) -> None:
        """A recovery reached ``phase`` (one of :data:`POINTS`); ``generation``: the one that
        failed (``rebuild`` on: the one being entered); ``step``: the step it was in, or the
        step restored. Optional: a hook without it is not called."""
        return None


def at_point(hooks: Sequence[object], phase: str, generation: int, step: int | None) -> None:
    """Each hook's ``on_phase`` (those that have one), in order; what one raises is raised here."""
    for h in hooks:
        told = getattr(h, "on_phase", None)
        if told is not None:
            told(phase, generation, step)


def discover(launch: LaunchEnv | None = None) -> list[StepHook]:
    """The hooks that are active now: those installed packages register under ``resilient.hooks``,
    then those ``RESILIENT_HOOKS`` names (``launch``: the launch environment, read if not given).
    A factory that fails to load or run is named in a warning and skipped."""
    if launch is None:
        launch = LaunchEnv.from_environ()
    registered = list(entry_points(group=ENTRY_POINT_GROUP))
    values = {ep.value for ep in registered}  # a factory named both ways is loaded once
    named = [EntryPoint(name=v, value=v, group=ENTRY_POINT_GROUP) for v in dict.fromkeys(launch.hooks)]
    found: list[StepHook] = []
    for ep in [*registered, *(ep for ep in named if ep.value not in values)]:
        try:
            hook = ep.load()()
        except Exception as e:  # a broken plug-in is named, and the run goes on without it
            logger.warning("step hook {!r} ({}) not loaded: {}: {}", ep.name, ep.value, type(e).__name__, e)
            continue
        if hook is not None:
            found.append(hook)
    return found
