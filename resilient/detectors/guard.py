"""The step guard: a step whose update would poison the weights is not let through.

A transient NaN or Inf in one step's gradients (a flipped bit, a bad kernel, an overflow) or a
gradient many times larger than the recent ones raises nothing by itself; once ``optimizer.step``
applies it the weights are poisoned for good. The guard looks at each tracked optimizer's
gradients in its step pre-hook, before they are applied: their norm (one fused pass, one value to
the host) must be finite and, once ``warmup`` values were seen, at most ``spike`` times the median
of the last ``window`` ones. A loss the function reports (``ctx.observe(loss=...)``) is held to
the same rules. A hit raises :class:`StepRejected` inside the step: a soft fault
like any exception, so every rank rolls back to the newest snapshot and replays, and a transient
fault ends bit-exact with the fault-free run.

What comes back at the same step on replay is the data's, not a fault: the recovery tells the
guard which step every rank agreed had faulted (:meth:`StepGuard.learn`, the same on every rank).
A spike seen again there is applied (``on_spike: accept``, what a run without the guard does;
each rank decides alone, and applying is what a rank that saw nothing does too). A non-finite
step seen again is a fault again, so that the verdict is taken in the next recovery, alike on every
rank: stop with :class:`~resilient.errors.FaultRepeats` naming the step and its batch, or skip
that batch (``skip_batch``: the next pass through it drops its gradients on every rank, so
the optimizer does not apply them; the data position moves on).

A step that clips its gradients (``torch.nn.utils.clip_grad_norm_``) hides a spike from the
optimizer: the guard reads the norm the clipping computed (before it clipped, every rank's the
same under FSDP2) instead of computing its own. It sees calls made through the module
(``torch.nn.utils.clip_grad_norm_(...)``, as Lightning and Accelerate make them) while the
function runs; a name imported before (``from torch.nn.utils import clip_grad_norm_``) is not
seen, and the guard computes the norm after clipping.

With a closure (``optimizer.step(closure)``: LBFGS, Lightning's automatic optimization) the
gradients exist only after the step ran: the check moves to the step's post-hook, the roll-back
then undoes the update, and ``skip_batch`` is not possible (the run stops instead).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field
from torch.utils.hooks import RemovableHandle

from resilient.detectors.base import AgreedFault, Detector, Emits, Run
from resilient.errors import FaultRepeats, SoftFault
from resilient.events import Event
from resilient.sections import Section

LOSS = "loss"  # the window of the observed loss (optimizers' windows are named after them)
REJECTED = ": the step is not applied; rolled back"


class GuardConfig(Section):
    """Steps that would poison the weights without raising: a non-finite gradient (or observed
    loss), or a spike against the recent values. Checked before a tracked optimizer applies the
    step (its step pre-hook); a hit rolls every rank back to the newest snapshot and replays."""

    nonfinite: bool = Field(True, description="a NaN/Inf in the gradients (or the observed loss) is a fault")
    spike: float = Field(
        10.0,
        ge=0,
        description="a gradient norm this many times the median of the last `window` ones is a spike "
        "fault; 0 turns the watch off",
    )
    loss_spike: float = Field(
        3.0, ge=0, description="the same for a loss reported with `ctx.observe(loss=...)`; 0: off"
    )
    window: int = Field(50, ge=1, description="values the spike rule takes the median of")
    warmup: int = Field(10, ge=1, description="values seen before the spike rule applies")
    on_nonfinite: Literal["stop", "skip_batch"] = Field(
        "stop",
        description="a non-finite step that comes back at the same step on replay (bad data): stop "
        "with FaultRepeats naming the step and batch, or skip that batch on every rank",
    )
    on_spike: Literal["accept", "skip_batch", "stop"] = Field(
        "accept",
        description="a spike that comes back at the same step on replay is the data's own: apply "
        "it (as a run without the guard would), skip that batch on every rank, or stop",
    )


class StepRejected(SoftFault):
    """A step the guard did not let reach the weights: every rank rolls back to the newest
    snapshot and replays it. ``step``: the step; ``where``: its batch (``epoch 2, batch 17``)
    where a data position is known."""

    rolls_back: ClassVar[bool] = True
    peers_finish_step: ClassVar[bool] = True  # (their state is good: the rejected step never reached it)

    def __init__(self, message: str, step: int | None, value: float, where: str | None = None) -> None:
        super().__init__(message)
        self.step = step
        self.value = value
        self.where = where


class NonFiniteStep(StepRejected):
    """A NaN or Inf in a step's gradients (before the optimizer applied them) or its observed loss."""

    symptom: ClassVar[str] = "nonfinite"


class SpikeStep(StepRejected):
    """A step's gradient norm (or observed loss) far above the median of the recent ones."""

    symptom: ClassVar[str] = "spike"


NONFINITE, SPIKE = NonFiniteStep.symptom, SpikeStep.symptom


def grad_norm(optimizer: torch.optim.Optimizer) -> tuple[float, bool] | None:
    """The 2-norm of ``optimizer``'s gradients as a float (one transfer to the host), and whether
    every gradient is finite; None when it has none. Finite gradients whose norm overflows give
    ``inf``, finite. A DTensor contributes its local shard only: no collective is issued here."""
    grads: list[torch.Tensor] = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            g = p.grad
            if g is None:
                continue
            if hasattr(g, "to_local"):  # a DTensor: this rank's shard
                g = g.to_local()
            if g.is_sparse:
                g = g.coalesce().values()
            grads.append(g)
    if not grads:
        return None
    norms = torch._foreach_norm(grads)  # one fused pass per device and dtype
    dev = norms[0].device
    value = float(torch.linalg.vector_norm(torch.stack([n.to(dev, torch.float32) for n in norms])))
    if math.isfinite(value):
        return value, True
    finite = all(bool(torch.isfinite(g).all()) for g in grads)  # (the rare path: which one it is)
    return (math.inf if finite else value), finite


class Window:
    """The recent values of one watched quantity, by step: a roll-back drops those of the steps
    it undid (their replay adds them again)."""

    def __init__(self, size: int) -> None:
        self.values: deque[tuple[int, float]] = deque(maxlen=size)

    def rewind(self, step: int) -> None:
        while self.values and self.values[-1][0] >= step:
            self.values.pop()

    def add(self, step: int, value: float) -> None:
        self.values.append((step, value))

    def median(self) -> float:
        return statistics.median(v for _, v in self.values)

    def __len__(self) -> int:
        return len(self.values)


class ClipWatch:
    """Sees ``torch.nn.utils.clip_grad_norm_`` while installed: the norm each call computed,
    before it clipped, by the parameters it clipped (see the module docstring)."""

    TARGETS = ((torch.nn.utils, "clip_grad_norm_"), (torch.nn.utils.clip_grad, "clip_grad_norm_"))

    def __init__(self, step: Callable[[], int | None]) -> None:
        self._step = step
        self.seen: list[tuple[int | None, frozenset[int], torch.Tensor]] = []  # (step, params, norm)
        self._undo: list[tuple[Any, str, Any]] = []

    def install(self) -> None:
        for module, name in self.TARGETS:
            original = getattr(module, name)
            if getattr(original, "__wrapped_by_guard__", False):
                continue  # (another run's watch in this process: one is enough)
            wrapped = self._wrap(original)
            setattr(module, name, wrapped)
            self._undo.append((module, name, original))

    def uninstall(self) -> None:
        for module, name, original in reversed(self._undo):
            setattr(module, name, original)
        self._undo.clear()

    def _wrap(self, original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def clip_grad_norm_(parameters: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
            params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            norm = original(params, *args, **kwargs)
            step = self._step()
            self.seen = [s for s in self.seen if s[0] == step][-7:]
            self.seen.append((step, frozenset(map(id, params)), norm))
            return norm

        clip_grad_norm_.__wrapped_by_guard__ = True  # type: ignore[attr-defined]
        clip_grad_norm_.__doc__ = original.__doc__
        return clip_grad_norm_

    def norm_of(self, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
        """The norm a clipping of this step computed over ``optimizer``'s parameters, if any."""
        step = self._step()
        ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
        for at, params, norm in reversed(self.seen):
            if at == step and ids <= params:
                return norm
        return None


class StepGuard(Detector):
    """See the module docstring. ``step``: the step being run; ``where``: its batch, described
    (None where no data position is known)."""

    name = "guard"
    summary = "a NaN/Inf or spiking gradient (or observed loss), refused before optimizer.step applies it"
    section = "guard"
    config = GuardConfig
    faults = (NonFiniteStep, SpikeStep)
    evidence = (Event.BATCH_SKIPPED, Event.SPIKE_ACCEPTED)

    @classmethod
    def build(cls, section: GuardConfig, run: Run) -> StepGuard:
        # (always built: with every rule off it watches nothing)
        return cls(section, run.events, lambda: run.step, run.where, lambda: run.generation)

    def __init__(
        self,
        cfg: GuardConfig,
        events: Emits,
        step: Callable[[], int | None],
        where: Callable[[], str | None] = lambda: None,
        generation: Callable[[], int] = lambda: 0,
    ) -> None:
        self.cfg = cfg
        self.events = events
        self._step = step
        self._where = where
        self._generation = generation
        self.windows: dict[str, Window] = {}
        self.faulted: dict[int, str] = {}  # step → kind, from faults every rank agreed on
        self.skip: set[int] = set()  # steps whose update every rank drops (skip_batch)
        self.checks = 0
        self._handles: list[RemovableHandle] = []
        self.clips = ClipWatch(step)

    @property
    def active(self) -> bool:
        c = self.cfg
        return c.nonfinite or c.spike > 0 or c.loss_spike > 0

    # -- the hooks ---------------------------------------------------------------------------------------
    def attach(self, name: str, optimizer: torch.optim.Optimizer) -> None:
        """Check ``optimizer``'s gradients before each of its steps (after, with a closure)."""
        if not self.active:
            return
        closure = [False]

        def before(opt: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            # (args: the step's own, the optimizer first)
            closure[0] = (len(args) > 1 and args[1] is not None) or kwargs.get("closure") is not None
            if not closure[0]:
                self.check(name, opt)

        def after(opt: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if closure[0]:
                self.check(name, opt, applied=True)

        self._handles += [optimizer.register_step_pre_hook(before), optimizer.register_step_post_hook(after)]

    def tracked(self, name: str, obj: Any) -> None:
        if isinstance(obj, torch.optim.Optimizer):
            self.attach(name, obj)

    def generation(self, number: int) -> None:
        self.detach()  # (the failed generation's optimizers)

    def restored(self, step: int) -> None:
        self.rewind(step)

    def recovering(self, fault: AgreedFault, history: list[dict[str, object]]) -> None:
        self.learn(fault, history)

    def detach(self) -> None:
        """A generation ended: its optimizers are no longer watched (the next one's are)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def install(self) -> None:
        """While the function runs: clipping is watched (see the module docstring)."""
        if self.active:
            self.clips.install()

    def uninstall(self) -> None:
        self.detach()
        self.clips.uninstall()

    def rewind(self, step: int) -> None:
        """The state of ``step`` was restored: the values of the steps after it are replayed."""
        for w in self.windows.values():
            w.rewind(step)

    # -- the checks --------------------------------------------------------------------------------------
    def check(self, name: str, optimizer: torch.optim.Optimizer, *, applied: bool = False) -> None:
        step = self._step()
        if step is not None and step in self.skip:
            if applied:
                raise self._repeats(step, "skip_batch needs a step without a closure")
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None  # the optimizer passes over a parameter without a gradient
            self.events.emit(
                Event.BATCH_SKIPPED,
                generation=self._generation(),
                step=step,
                optimizer=name,
                batch=self._where(),
            )
            return
        self.checks += 1
        clipped = None if applied else self.clips.norm_of(optimizer)
        if clipped is not None:  # (before clipping; non-finite: the gradients are non-finite now too)
            value = float(clipped)
            got: tuple[float, bool] | None = (value, math.isfinite(value))
        else:
            got = grad_norm(optimizer)
        if got is None:
            return
        value, finite = got
        if not finite:
            if self.cfg.nonfinite:
                self._reject(NonFiniteStep, step, value, f"non-finite gradient (norm {value}) of {name!r}")
            return
        self._watch(name, step, value, self.cfg.spike, f"gradient norm of {name!r}")

    def observed(self, loss: Any) -> None:
        """``ctx.observe(loss=...)``: the loss of the step being run (a tensor or a number)."""
        if not self.active:
            return
        step = self._step()
        value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
        if not math.isfinite(value):
            if self.cfg.nonfinite:
                self._reject(NonFiniteStep, step, value, f"non-finite loss ({value})")
            return
        self._watch(LOSS, step, value, self.cfg.loss_spike, "loss")

    def _watch(self, name: str, step: int | None, value: float, factor: float, what: str) -> None:
        window = self.windows.get(name)
        if window is None:
            window = self.windows[name] = Window(self.cfg.window)
        s = -1 if step is None else step
        if factor > 0 and len(window) >= self.cfg.warmup:
            median = window.median()
            if median > 0 and value > factor * median:
                if self.faulted.get(s) == SPIKE and self.cfg.on_spike == "accept":
                    self.events.emit(
                        Event.SPIKE_ACCEPTED,
                        generation=self._generation(),
                        step=step,
                        value=value,
                        median=median,
                        what=what,
                        batch=self._where(),
                    )
                else:
                    self._reject(
                        SpikeStep,
                        step,
                        value,
                        f"{what} {value:.4g} is {value / median:.1f}x the median of the last {len(window)} "
                        f"({median:.4g}; guard.{'spike' if name != LOSS else 'loss_spike'}: {factor:g})",
                    )
        window.add(s, value)

    def _reject(self, cls: type[StepRejected], step: int | None, value: float, what: str) -> None:
        where = self._where()
        at = f"step {step}" + (f" ({where})" if where else "")
        raise cls(f"{what} at {at}{REJECTED}", step, value, where)

    # -- what the recovery tells it ------------------------------------------------------------------------
    def learn(self, fault: AgreedFault, history: list[dict[str, object]]) -> None:
        """Every rank agreed ``fault`` ended the generation (in the recovery, before the restart
        policy's verdict). A guard fault seen at this step before is the data's: stop (raises
        :class:`FaultRepeats`) or skip the batch, as configured."""
        kind, step = fault.kind, fault.step
        if kind not in (NONFINITE, SPIKE) or step is None:
            return
        if self.faulted.get(step) == kind:
            how = self.cfg.on_nonfinite if kind == NONFINITE else self.cfg.on_spike
            if how == "skip_batch":
                self.skip.add(step)
            elif how == "stop":
                what = "on_nonfinite" if kind == NONFINITE else "on_spike"
                raise FaultRepeats(
                    step,
                    f"{fault.message.split(': ', 1)[-1].removesuffix(REJECTED)}: it came back on replay, so "
                    "it is the data's, not "
                    f"a transient fault (guard.{what}: stop; skip_batch would skip that batch)",
                    2,
                    history,
                )
        self.faulted[step] = kind

    def _repeats(self, step: int, why: str) -> FaultRepeats:
        return FaultRepeats(step, f"nonfinite: the step's update cannot be skipped ({why})", 2, [])
