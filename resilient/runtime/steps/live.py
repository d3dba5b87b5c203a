"""Live resume: a soft fault costs the step it hit, not the steps since the newest snapshot.

At a soft fault the process survives, and with it the model and the optimizer: their large state
(parameters, optimizer moments, FSDP2 shards) is usually exactly what it was when the faulted step
began, because the step never reached ``optimizer.step``. What a step changes before that is
small: every RNG, the data position, the epoch, the scheduler, a gradient scaler, the buffers a
forward updates (BatchNorm's running statistics), small tracked objects. :class:`LiveResume`
copies that small state where the ring would capture a snapshot of the step (its start), at every
step, and at a fault each rank *vouches* for its large state:

- no tracked optimizer's step ran, nor began its update, since that capture (its hooks count; a
  step the guard rejects in its pre-hook, before any update, did not begin; with a closure the
  update begins once the closure's forward and backward returned);
- every tensor kept by reference (parameters, optimizer state, buffers not copied, gradients
  pending in an accumulation window) is the same tensor with the same version counter: an
  in-place change anywhere (a clamp, an EMA update, ``load_state_dict``) moves it;
- the fault is not one that casts doubt on the state itself (replicas that differ, collectives
  that differ) and the process is not a replacement whose predecessor's state died with it.

Where every rank vouches for the same step after the same number of collectives, the recovery
barrier agrees on it (``restore_plan``'s ``live``): the next generation loads the live tensors
into the objects it tracks (a new model is a device copy of the old; the same object, no copy), the
small state from the capture, and no gradient of the failed step. Anything else falls back to the
ring, shared memory or a checkpoint, and the ``restore_agreed`` event says which rank could not
vouch, and why.
"""

from __future__ import annotations

import copy
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from resilient.detectors import REGISTRY as DETECTORS
from resilient.errors import StepInterrupted
from resilient.state import dtensor
from resilient.state.carry import Carried, tensors_of
from resilient.state.registry import GRAD, RNG, Registry, capture_rng
from resilient.state.snapshot import Frozen
from resilient.state.tree import map_leaves

# the faults whose state is in doubt: a detector's fault says so itself (``doubts_state``: replicas
# that differ, collectives that differ), and a record that does not parse
DOUBTS = {**DETECTORS.doubts(), "malformed": "unparsable"}


@dataclass
class _Later:
    """A small state resolved only when it is restored (a GPU scaler's values, read without a sync)."""

    make: Callable[[], Any]


@dataclass
class _Kept:
    """One tracked object's part of a capture: tensors kept by reference, with their versions."""

    tensors: list[torch.Tensor]
    versions: int
    state: Any = None  # the copy of a small object's whole state
    buffers: dict[str, Any] = field(default_factory=dict)  # a module's copied buffers (and extra state)
    groups: list[dict[str, Any]] | None = None  # an optimizer's hyperparameters (a scheduler sets them)
    grads: frozenset[int] | None = None  # a module's pending gradients, where they are state (accumulating)


@dataclass
class _Capture:
    step: int
    objects: dict[str, _Kept]
    rng: dict[str, Any]
    seq: int  # collectives issued on the group when it was taken (-1: unknown)
    began: int  # tracked optimizers' steps begun ...
    ended: int  # ... and ended, then
    refused: str | None  # why this step cannot be vouched for whatever happens (a large small object)


class LiveResume:
    """See the module docstring. One per run; ``generation()`` forgets the failed generation's
    objects. ``max_bytes``: what is copied at each step (the small objects, the modules' buffers)
    holds at most this many tensor bytes; where more, a fault there falls back, naming the object."""

    def __init__(self, enabled: bool, max_bytes: int, capture: bool = False) -> None:
        self.enabled = enabled
        self.capturing = enabled or capture  # (replay verification digests the capture too)
        self.max_bytes = max_bytes
        self.cap: _Capture | None = None
        self.began = 0
        self.ended = 0
        self._in_step = False  # between a tracked optimizer's pre- and post-hook
        self._leaving: tuple[int, str] | None = None  # a peer's fault this rank leaves at its step's end
        self._leave_lock = threading.Lock()
        self._handles: list[Any] = []
        self._hooked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._tensors: dict[str, _ModuleTensors] = {}

    # -- the loop's fixed points ---------------------------------------------------------------------
    def generation(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._hooked = weakref.WeakSet()
        self._in_step = False
        self.cap = None
        self._tensors.clear()

    def tracked(self, name: str, obj: Any) -> None:
        """Count ``obj``'s steps (hooks registered after the detectors': a step the guard rejects
        before its update never reaches them); a model's meshes are described now, while their
        group is alive (:meth:`state` makes the live state portable after it is gone)."""
        if self.enabled and isinstance(obj, torch.nn.Module):
            dtensor.remember_meshes(obj)
        if not self.enabled or not isinstance(obj, torch.optim.Optimizer) or obj in self._hooked:
            return
        self._hooked.add(obj)
        self._handles += [
            obj.register_step_pre_hook(self._began),
            obj.register_step_post_hook(self._ended),
        ]

    def past_update(self) -> bool:
        """A tracked optimizer's update ran in the step being run and none is running now: the
        step's tail (the scheduler, logging), which the rank may finish before it leaves, so
        that the state it leaves is the next step's start, captured."""
        return self.enabled and self.cap is not None and self.ended > self.cap.ended and not self._in_step

    def updating(self) -> bool:
        """A tracked optimizer's update (not a closure's forward and backward) is running now."""
        return self.enabled and self.cap is not None and self._in_step and self.began > self.cap.began

    def leave_at_step_end(self, generation: int, running: int, reason: str, *, behind: bool = False) -> bool:
        """A peer faulted (the listener's thread): a rank past its optimizer's update, or in it (a
        local update that ends in milliseconds), finishes the step and leaves at its end, its
        state captured (True), instead of being interrupted where it is, where it could vouch for
        nothing. ``behind``: the peer faulted in the next step, so it completed this one, and every
        collective of this step was issued here too: what is left of it is this rank's own work,
        wherever it is in the step. ``running``: the generation the main thread is in."""
        with self._leave_lock:
            if not (behind or self.past_update() or self.updating()) or running != generation:
                return False
            self._leaving = (generation, reason)
            return True

    def take_leaving(self, generation: int) -> bool:
        """The grace is over: whether the rank had not left yet (it is interrupted where it is)."""
        with self._leave_lock:
            if self._leaving is None or self._leaving[0] != generation:
                return False
            self._leaving = None
            return True

    def leave_if_asked(self, running: int) -> None:
        """At the end of a step, once its successor's state is captured."""
        with self._leave_lock:
            leaving, self._leaving = self._leaving, None
        if leaving is not None and leaving[0] == running:
            raise StepInterrupted(leaving[1])

    def _began(self, opt: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A step's update begins now, or, with a closure (Lightning's automatic optimization,
        LBFGS), once its closure returned: a fault in the forward and backward it runs leaves
        the parameters as they were."""
        self._in_step = True
        closure = args[1] if len(args) > 1 else kwargs.get("closure")
        if closure is None:
            self.began += 1
            return None

        def counted() -> Any:
            out = closure()
            self.began += 1  # (the update follows; an LBFGS line search calls it again, later)
            return out

        if len(args) > 1:
            return (args[0], counted, *args[2:]), kwargs
        return args, {**kwargs, "closure": counted}

    def _ended(self, *_: Any) -> None:
        self.ended += 1
        self._in_step = False

    def capture(
        self,
        step: int,
        registry: Registry,
        accumulating: bool,
        seq: int,
        loaded: dict[str, Any] | None = None,
    ) -> None:
        """The small state at ``step``'s start (where the ring would snapshot it), the large
        state's versions beside it. ``accumulating``: the gradients now pending are state.
        ``loaded``: the state a restore just loaded, whose small objects' parts are copied from
        it: asking a loader that has not begun its pass for its ``state_dict`` may begin one
        (torchdata's ``StatefulDataLoader`` starts its iterator, drawing its seeds, earlier than
        the function would)."""
        if not self.capturing:
            return
        objects: dict[str, _Kept] = {}
        refused = None
        budget = self.max_bytes
        for name, obj in zip(registry.names(), registry.objects(), strict=True):
            kept: _Kept | None
            if isinstance(obj, torch.nn.Module):
                n = self._buffer_bytes(name, obj)
                kept = self._module(name, obj, accumulating, n <= budget)
            elif isinstance(obj, torch.optim.Optimizer):
                n, kept = 0, self._optimizer(obj)
            elif isinstance(obj, Carried):  # (its tensors by reference: a carried value is replaced)
                refs = obj.state_dict()
                tensors = [t for v in refs.values() for t in tensors_of(v)]
                n = sum(t.numel() * t.element_size() for t in tensors)
                kept = _Kept(tensors, _versions(tensors), state=refs) if n <= budget else None
            else:
                state = _small(obj) if loaded is None or loaded.get(name) is None else _copied(loaded[name])
                n = _tensor_bytes(state)
                kept = _Kept([], 0, state=state) if n <= budget else None
            if n > budget and refused is None:
                refused = (
                    f"tracked object {name!r} holds {n} tensor bytes copied at each step (its buffers, "
                    f"or its state), more than snapshot.live_max_bytes ({self.max_bytes}) leaves"
                )
            budget -= n
            if kept is not None:
                objects[name] = kept
        self.cap = _Capture(step, objects, capture_rng(), seq, self.began, self.ended, refused)

    def withdraw(self, why: str) -> None:
        """The capture just taken is not a step's start after all (a detector refused the step
        that ended): a fault now falls back, saying ``why``."""
        if self.cap is not None:
            self.cap.refused = why

    def _cached(self, name: str, m: torch.nn.Module) -> _ModuleTensors:
        cached = self._tensors.get(name)
        if cached is None:  # (once a generation: a model's tensors keep their identity while it trains)
            cached = self._tensors[name] = _ModuleTensors.of(m)
        return cached

    def _buffer_bytes(self, name: str, m: torch.nn.Module) -> int:
        return self._cached(name, m).buffer_bytes

    def _module(self, name: str, m: torch.nn.Module, accumulating: bool, copy_buffers: bool) -> _Kept:
        mt = self._cached(name, m)
        kept = mt.params
        copies: dict[str, Any] = {}
        if copy_buffers:
            copies = {k: t.detach().clone() for k, t in mt.buffers.items()}
        if mt.extra:  # (extra state changes as it likes: read afresh, only where a module has some)
            now = m.state_dict()
            copies.update({k: copy.deepcopy(now[k]) for k in mt.extra})
        grads = [p.grad for p in kept if p.grad is not None]
        if grads and (accumulating or self.cap is None):  # (a generation's start: what a restore put back)
            return _Kept(
                kept + grads, _versions(kept + grads), buffers=copies, grads=frozenset(map(id, grads))
            )
        return _Kept(kept, _versions(kept), buffers=copies)

    def _optimizer(self, opt: torch.optim.Optimizer) -> _Kept:
        kept = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        groups = [{k: _copy_leaf(v) for k, v in g.items() if k != "params"} for g in opt.param_groups]
        return _Kept(kept, _versions(kept), groups=groups)

    # -- at a fault ------------------------------------------------------------------------------------
    def offer(self, symptom: str | None, registry: Registry) -> dict[str, Any]:
        """What this rank posts to the recovery barrier: the step it vouches for and the
        collectives issued before it, or why it cannot."""
        why = self._why_not(symptom, registry)
        if why is not None:
            return {"why": why}
        assert self.cap is not None
        return {"step": self.cap.step, "seq": self.cap.seq}

    def _why_not(self, symptom: str | None, registry: Registry) -> str | None:
        cap = self.cap
        if not self.enabled:
            return "snapshot.live is off"
        if cap is None:
            return "no state was captured in this generation yet"
        if symptom in DOUBTS:
            return f"a {symptom} fault ({DOUBTS[symptom]}): the live state is not trusted"
        if cap.refused:
            return cap.refused
        if self.ended != cap.ended:
            return f"an optimizer step ran after step {cap.step} began"
        if self.began != cap.began:
            return f"the fault came inside an optimizer step (step {cap.step})"
        names = registry.names()
        for name, obj in zip(names, registry.objects(), strict=True):
            kept = cap.objects.get(name)
            if kept is None and isinstance(obj, torch.nn.Module | torch.optim.Optimizer):
                return f"{name!r} was tracked after step {cap.step} began"
            if kept is None or (kept.state is not None and not kept.tensors):
                continue
            if isinstance(obj, torch.nn.Module):
                then, now = self._tensors[name].tensors, _ModuleTensors.of(obj).tensors
                if then.keys() != now.keys() or any(now[k] is not t for k, t in then.items()):
                    return f"{name!r}: a parameter or buffer was replaced after step {cap.step} began"
                grads = frozenset(id(p.grad) for p in obj.parameters() if p.grad is not None)
                if kept.grads is not None and grads != kept.grads:
                    return f"{name!r}: its accumulated gradients were replaced after step {cap.step} began"
            if _versions(kept.tensors) != kept.versions:
                return f"{name!r} changed in place in step {cap.step} (its tensors' versions moved)"
        return None

    def state(self, registry: Registry) -> dict[str, Any]:
        """The state to resume at the vouched step: the live tensors (not copied), the small state
        as captured, and no gradients but those an accumulation window keeps."""
        cap = self.cap
        assert cap is not None
        out: dict[str, Any] = {}
        for name, obj in zip(registry.names(), registry.objects(), strict=True):
            kept = cap.objects.get(name)
            if kept is None:
                continue
            if kept.state is not None:
                out[name] = _resolve(kept.state)
            elif isinstance(obj, torch.nn.Module):
                sd = dict(obj.state_dict())
                sd.update(kept.buffers)
                if kept.grads is not None:
                    sd[GRAD] = {n: p.grad for n, p in obj.named_parameters() if p.grad is not None}
                out[name] = dtensor.to_portable(sd)
            else:  # an optimizer
                sd = obj.state_dict()
                groups = [dict(g, **h) for g, h in zip(sd["param_groups"], kept.groups or [], strict=True)]
                out[name] = dtensor.to_portable({**sd, "param_groups": groups})
        out[RNG] = cap.rng
        return out


@dataclass
class _ModuleTensors:
    """A module's state_dict entries as a generation's first capture found them: its tensors by
    key (the live parameters and persistent buffers), the parameters among them, the buffers, and
    the keys of what is not a tensor (extra state)."""

    tensors: dict[str, torch.Tensor]
    params: list[torch.Tensor]
    buffers: dict[str, torch.Tensor]
    extra: list[str]
    buffer_bytes: int

    @classmethod
    def of(cls, m: torch.nn.Module) -> _ModuleTensors:
        entries = m.state_dict(keep_vars=True)
        tensors = {k: v for k, v in entries.items() if isinstance(v, torch.Tensor)}
        ids = {id(p) for p in m.parameters()}
        buffers = {k: t for k, t in tensors.items() if id(t) not in ids}
        params = [t for t in tensors.values() if id(t) in ids]
        extra = [k for k in entries if k not in tensors]
        return cls(
            tensors, params, buffers, extra, sum(t.numel() * t.element_size() for t in buffers.values())
        )


def _small(obj: Any) -> Any:
    """A copy of a small object's state now (None: nothing to keep)."""
    if isinstance(obj, torch.Generator):
        return {"generator": obj.get_state()}
    scaler = getattr(torch.amp, "GradScaler", None)
    if scaler is not None and isinstance(obj, scaler) and getattr(obj, "_scale", None) is not None:
        return _scaler(obj)
    return _copied(dtensor.to_portable(obj.state_dict()))


def _copied(state: Any) -> Any:
    return map_leaves(_copy_leaf, state, typed=(torch.Tensor, _clone))


def _scaler(s: Any) -> _Later:
    """A GradScaler's state without reading its scale back from the device at every step (its
    ``state_dict`` syncs): its tensors copied on the device, the dict made if it is restored."""
    scale, tracker = s._scale.detach().clone(), s._growth_tracker.detach().clone()
    rest = {k: getattr(s, f"_{k}") for k in ("growth_factor", "backoff_factor", "growth_interval")}

    def make() -> dict[str, Any]:
        return {"scale": scale.item(), **rest, "_growth_tracker": tracker.item()}

    return _Later(make)


def _resolve(state: Any) -> Any:
    return state.make() if isinstance(state, _Later) else state


def _clone(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone()


_IMMUTABLE = (Frozen, int, float, str, bool, type(None))


def _copy_leaf(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.detach().clone()
    if isinstance(v, _IMMUTABLE) or (type(v) is tuple and all(isinstance(x, _IMMUTABLE) for x in v)):
        return v  # (an optimizer's betas: a tuple of numbers is its own copy)
    return copy.deepcopy(v)


def _tensor_bytes(state: Any) -> int:
    if isinstance(state, _Later):
        return 0
    total = 0

    def count(t: torch.Tensor) -> None:
        nonlocal total
        total += t.numel() * t.element_size()

    map_leaves(lambda v: None, state, typed=(torch.Tensor, count))
    return total


def _versions(tensors: list[torch.Tensor]) -> int:
    return sum(t._version for t in tensors)
