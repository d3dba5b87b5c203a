"""The harness's step hook: how a certificate reaches into any wrapped script, unchanged.

Loaded only in a chaos job: the harness names :data:`FACTORY` in the job's ``RESILIENT_HOOKS``
(the runtime's hook-loading variable, resilient/runtime/hooks.py; :func:`enable`), so a plain
training process never imports ``chaos``. :func:`from_env` returns a hook when the job's
environment asks for one (the variables of :class:`Var`, which ``chaos/job.py`` sets). The hook

- fires the plan's faults at the start of their step, in their rank, and ends a fault that lasts
  its step once the step completed (:mod:`chaos.inject`); a fault planned at a recovery's point,
  when the rank's recovery reaches it (``on_phase``);
- writes a ``step_completed`` event per step (the certificate's timeline);
- dumps the final tracked state of each rank, which the certificate compares bit for bit with a
  fault-free run's;
- digests each tracked object at every step's start (:class:`StepDigests`): where a trial ends
  other than the fault-free run, the first step and the objects that differ say why.
"""

from __future__ import annotations

import contextlib
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
    DIGESTS = "CHAOS_DIGESTS"  # a directory: rank<R>.jsonl, each step's start digested per object

    def __str__(self) -> str:
        return self.value


class StepDigests:
    """Each step start's tracked objects, digested (exact tensor sums, as the runtime's
    fingerprints are) and appended to ``<dir>/rank<R>.jsonl``; a step run again is recorded again
    (the last record is the one the run went on from). The RNGs are left out, as the final
    comparison leaves them out: a script need not seed the generators it never draws from."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path: Path | None = None
        self.generation = 0

    def start(self, rank: int) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / f"rank{rank}.jsonl"

    def record(self, step: int, objects: Sequence[object]) -> None:
        import json

        import torch

        from resilient.runtime.keeping.resume import fingerprint
        from resilient.state import dtensor

        if self.path is None:
            return
        names = getattr(objects, "names", None) or [f"#{i}" for i in range(len(objects))]
        out: dict[str, str] = {}
        for name, obj in zip(names, objects, strict=False):
            try:
                state = obj.get_state() if isinstance(obj, torch.Generator) else obj.state_dict()  # type: ignore[attr-defined]
                out[name] = fingerprint(dtensor.to_portable(state))
            except Exception as e:  # (an object the codec does not take: named, not compared)
                out[name] = f"unreadable: {type(e).__name__}"
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, "digests": out}) + "\n")


def first_divergence(reference: Path, trial: Path) -> dict[str, Any] | None:
    """The first step whose start differs between two jobs' :class:`StepDigests` (each step's last
    record on each rank), with the objects that differ and on which ranks; None: none differs."""
    import json

    def last(path: Path) -> dict[int, dict[str, str]]:
        out: dict[int, dict[str, str]] = {}
        if path.exists():
            for line in path.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    rec = json.loads(line)
                    out[int(rec["step"])] = rec["digests"]
        return out

    found: dict[int, dict[str, set[int]]] = {}
    for ref_file in sorted(reference.glob("rank*.jsonl")):
        rank = int(ref_file.stem.removeprefix("rank"))
        a, b = last(ref_file), last(trial / ref_file.name)
        for step in sorted(set(a) & set(b)):
            differ = sorted(k for k in set(a[step]) | set(b[step]) if a[step].get(k) != b[step].get(k))
            if differ:
                for k in differ:
                    found.setdefault(step, {}).setdefault(k, set()).add(rank)
                break
    if not found:
        return None
    step = min(found)
    return {"step": step, "objects": sorted(found[step]), "ranks": sorted(set().union(*found[step].values()))}


class ChaosHook(Hook):
    def __init__(
        self,
        injector: Injector | None,
        step_events: bool,
        final_state: Path | None,
        digests: StepDigests | None = None,
    ) -> None:
        self.injector = injector
        self.step_events = step_events
        self.final_state = final_state
        self.digests = digests
        self.rank = 0
        self._events: EventLog | None = None

    def on_start(self, run: RunInfo) -> None:
        self.rank = run.rank
        # the runtime logs every step itself when its config says so: not twice
        self._events = run.events if self.step_events and not run.config.events.steps else None
        if self.digests is not None:
            self.digests.start(run.rank)

    def before_step(self, step: int, objects: Sequence[object]) -> None:
        if self.digests is not None:  # (before a planned fault: the step's start as it was)
            self.digests.record(step, objects)
        if self.injector is not None:
            for where in ("step", "before_collective"):  # (both at the step's start here)
                self.injector.maybe_fire(self.rank, step, where, objects=objects)

    def after_step(self, generation: int, step: int, step_s: float | None) -> None:
        if self.injector is not None:  # (a one-step fault ends with its step, and says if it acted)
            self.injector.step_over()
        if self._events is not None:
            ev = Event.STEP_COMPLETED
            self._events.emit(ev, generation=generation, step=step, step_s=step_s, log=False)

    def on_phase(self, phase: str, generation: int, step: int | None) -> None:
        if self.injector is not None:  # (a compound class's second fault: chaos/inject.py)
            self.injector.at_point(self.rank, phase)

    def on_finish(self, final_state: Callable[[], Mapping[str, Any]]) -> None:
        if self.injector is not None:
            self.injector.step_over()
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
    digests = env.get(Var.DIGESTS.value)
    if not (plan or step_events or final or digests):
        return None
    injector = None
    if plan and (only is None or int(only) == LaunchEnv.from_environ(env).restart_count):
        injector = Injector.parse(plan)
    return ChaosHook(
        injector, step_events, Path(final) if final else None, StepDigests(Path(digests)) if digests else None
    )


def enable(env: MutableMapping[str, str]) -> MutableMapping[str, str]:
    """Name the chaos hook in ``env``'s ``RESILIENT_HOOKS`` (after any hooks already named there)
    when ``env`` asks for chaos (one of :class:`Var`); returns ``env``."""
    if any(env.get(v.value) for v in Var):
        named = [h.strip() for h in env.get(LaunchVar.HOOKS.value, "").split(",") if h.strip()]
        if FACTORY not in named:
            env[LaunchVar.HOOKS.value] = ",".join([*named, FACTORY])
    return env
