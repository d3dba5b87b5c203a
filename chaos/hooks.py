"""The harness's step hook: how a certificate reaches into any wrapped script, unchanged.

Loaded only in a chaos job: the harness names :data:`FACTORY` in the job's ``RESILIENT_HOOKS``
(the runtime's hook-loading variable, resilient/runtime/hooks.py; :func:`enable`), so a plain
training process never imports ``chaos``. :func:`from_env` returns a hook when the job's
environment asks for one (the variables of :class:`Var`, which ``chaos/job.py`` sets). The hook

- fires the plan's faults at the start of their step, in their rank (:mod:`chaos.inject`);
- writes a ``step_completed`` event per step (the certificate's timeline);
- dumps the final tracked state of each rank, which the certificate compares bit for bit with a
  fault-free run's.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import Any

from chaos.inject import Injector
from resilient.events import Event, EventLog
from resilient.launch_env import LaunchEnv
from resilient.launch_env import Var as LaunchVar
from resilient.runtime.hooks import Hook, RunInfo

FACTORY = "chaos.hooks:from_env"  # what RESILIENT_HOOKS names in a chaos job


class Var(str, enum.Enum):
    """The environment a chaos job hands its workers."""

    PLAN = "CHAOS_PLAN"  # kind@step[:rank],... (chaos/inject.py's plan)
    PLAN_ATTEMPT = "CHAOS_PLAN_ATTEMPT"  # fire only in this launch attempt (torchrun's restart count)
    STEP_EVENTS = "CHAOS_STEP_EVENTS"  # "1": a step_completed event per step
    FINAL_STATE = "CHAOS_FINAL_STATE"  # a directory: rank<R>.pt of the final tracked state
    INJECTIONS = "CHAOS_INJECTIONS"  # the job's record of what fired (chaos/inject.py)

    def __str__(self) -> str:
        return self.value


class ChaosHook(Hook):
    def __init__(self, injector: Injector | None, step_events: bool, final_state: Path | None) -> None:
        self.injector = injector
        self.step_events = step_events
        self.final_state = final_state
        self.rank = 0
        self._events: EventLog | None = None

    def on_start(self, run: RunInfo) -> None:
        self.rank = run.rank
        # the runtime logs every step itself when its config says so: not twice
        self._events = run.events if self.step_events and not run.config.events.steps else None

    def before_step(self, step: int, objects: Sequence[object]) -> None:
        if self.injector is not None:
            for where in ("step", "before_collective"):  # (both at the step's start here)
                self.injector.maybe_fire(self.rank, step, where, objects=objects)

    def after_step(self, generation: int, step: int, step_s: float | None) -> None:
        if self._events is not None:
            ev = Event.STEP_COMPLETED
            self._events.emit(ev, generation=generation, step=step, step_s=step_s, log=False)

    def on_finish(self, final_state: Callable[[], Mapping[str, Any]]) -> None:
        if self.final_state is None:
            return
        import torch

        self.final_state.mkdir(parents=True, exist_ok=True)
        torch.save(dict(final_state()), self.final_state / f"rank{self.rank}.pt")


def from_env(environ: Mapping[str, str] | None = None) -> ChaosHook | None:
    """The hook a chaos job asked for, or None in any other process."""
    env = os.environ if environ is None else environ
    plan, only = env.get(Var.PLAN.value), env.get(Var.PLAN_ATTEMPT.value)
    step_events = env.get(Var.STEP_EVENTS.value) == "1"
    final = env.get(Var.FINAL_STATE.value)
    if not (plan or step_events or final):
        return None
    injector = None
    if plan and (only is None or int(only) == LaunchEnv.from_environ(env).restart_count):
        injector = Injector.parse(plan)
    return ChaosHook(injector, step_events, Path(final) if final else None)


def enable(env: MutableMapping[str, str]) -> MutableMapping[str, str]:
    """Name the chaos hook in ``env``'s ``RESILIENT_HOOKS`` (after any hooks already named there)
    when ``env`` asks for chaos (one of :class:`Var`); returns ``env``."""
    if any(env.get(v.value) for v in Var):
        named = [h.strip() for h in env.get(LaunchVar.HOOKS.value, "").split(",") if h.strip()]
        if FACTORY not in named:
            env[LaunchVar.HOOKS.value] = ",".join([*named, FACTORY])
    return env
