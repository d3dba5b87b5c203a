"""The registry of tracked state: user objects with ``state_dict``/``load_state_dict`` and every RNG.

Objects are tracked by name. ``torch.Generator`` (a common data-order source) is supported through
its ``get_state``/``set_state``. RNG state covers Python ``random``, NumPy's global generator, torch
CPU and, when CUDA is initialized, every CUDA device.

Gradients are not part of a ``state_dict``. A step that ends inside a gradient-accumulation window
(each micro-batch a step; the optimizer steps every few) leaves gradients that the next steps add
to, so a tracked module's state then also holds its ``.grad`` tensors (under :data:`GRAD`): kept
when a tracked optimizer did not step during the step just completed and some gradient exists.
"""

from __future__ import annotations

import random
import weakref
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch.utils.data import DataLoader

from resilient.errors import SnapshotError, StateRestoreError
from resilient.state import dtensor
from resilient.state.loader import is_stateful_loader, make_resumable
from resilient.state.snapshot import Frozen
from resilient.state.tree import map_leaves

RNG = "__rng__"
GRAD = "__grad__"  # in a module's state: its gradients, when a step ended inside an accumulation window
EPOCHS = "__epochs__"  # ctx.epochs' position (the runtime tracks it)


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


def capture_rng() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": Frozen(random.getstate()),
        "numpy": Frozen(np.random.get_state()),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    py, npy = state["python"], state["numpy"]
    random.setstate(py.value if isinstance(py, Frozen) else py)
    np.random.set_state(npy.value if isinstance(npy, Frozen) else npy)
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Registry:
    """Named objects whose state the runtime snapshots after good steps and restores after faults."""

    def __init__(self) -> None:
        self._objects: dict[str, Any] = {}
        self._optimizer_steps = 0  # by tracked optimizers (a hook counts them)
        self._steps_at_start: int | None = None  # ... when the current step began
        self._hooked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()

    def __contains__(self, name: str) -> bool:
        return name in self._objects

    def names(self) -> list[str]:
        return list(self._objects)

    def objects(self) -> list[Any]:
        return list(self._objects.values())

    def add(self, name: str, obj: Any) -> None:
        if name == RNG:
            raise ValueError(f"{RNG!r} is reserved for the RNG state")
        if isinstance(obj, DataLoader) and (not isinstance(obj, Stateful) or is_stateful_loader(obj)):
            # a plain DataLoader: its position becomes state; torchdata's StatefulDataLoader: it
            # resumes without drawing from the restored RNG again (state/loader.py)
            make_resumable(obj)
        if not isinstance(obj, torch.Generator | Stateful):
            raise TypeError(
                f"cannot track {name}={type(obj).__name__}: it needs state_dict()/load_state_dict() "
                "(or be a torch.Generator)"
            )
        if isinstance(obj, torch.optim.Optimizer) and obj not in self._hooked:
            try:
                obj.register_step_post_hook(self._optimizer_stepped)
            except AttributeError as e:  # a wrapper that never ran Optimizer.__init__ (Accelerate's)
                raise TypeError(
                    f"cannot track {name}={type(obj).__name__}: it wraps an optimizer without being "
                    f"one ({e}); track the optimizer it wraps ({name}=<it>.optimizer), or for "
                    "objects from accelerator.prepare use resilient.integrations.hf.trackable(...)"
                ) from e
            self._hooked.add(obj)
        self._objects[name] = obj

    def _optimizer_stepped(self, *_: Any) -> None:
        self._optimizer_steps += 1

    def step_begins(self) -> None:
        self._steps_at_start = self._optimizer_steps

    def accumulating(self) -> bool:
        """The step just completed ran no tracked optimizer's step (its gradients are pending)."""
        return (
            self._steps_at_start is not None
            and self._optimizer_steps == self._steps_at_start
            and any(isinstance(o, torch.optim.Optimizer) for o in self._objects.values())
        )

    def clear(self) -> None:
        self._objects.clear()

    def capture(self) -> dict[str, Any]:
        """The current state of every tracked object plus the RNGs (tensors are not copied here)."""
        out: dict[str, Any] = {}
        accumulating = self.accumulating()
        for name, obj in self._objects.items():
            try:
                if isinstance(obj, torch.Generator):
                    out[name] = {"generator": obj.get_state()}
                    continue
                state = obj.state_dict()
                if accumulating and isinstance(obj, torch.nn.Module):
                    grads = {n: p.grad for n, p in obj.named_parameters() if p.grad is not None}
                    if grads:
                        state = {**state, GRAD: grads}
                out[name] = dtensor.to_portable(state)
            except Exception as e:
                what = f"tracked object {name!r} ({type(obj).__name__})"
                raise SnapshotError(f"{what}: state_dict() failed: {type(e).__name__}: {e}") from e
        out[RNG] = capture_rng()
        return out

    def load(self, name: str, state: Any, *, owned: bool = True) -> None:
        """Load ``state`` into the object tracked as ``name``. ``owned=False``: its tensors are views
        of memory that is not the object's to keep (a mapped snapshot): a module and a generator
        copy them as they load; anything else (an optimizer keeps the tensors it is given) gets
        copies, made here: one copy either way."""
        obj = self._objects[name]
        if not owned and isinstance(obj, torch.optim.Optimizer) and not dtensor.holds_dtensors(state):
            state = _into_optimizer_state(obj, state)
        elif not owned and not isinstance(obj, torch.nn.Module | torch.Generator):
            state = _owned_copy(state)
        if dtensor.holds_dtensors(state):  # back onto the mesh the rebuilt objects live on
            state = dtensor.from_portable(state, dtensor.live_meshes(self._objects.values()), name)
        grads = None
        if isinstance(state, dict) and GRAD in state:
            state = dict(state)
            grads = state.pop(GRAD)
        try:
            if isinstance(obj, torch.Generator):
                obj.set_state(state["generator"])
            else:
                obj.load_state_dict(state)
                if isinstance(obj, torch.nn.Module):  # (none pending: the failed step's are dropped)
                    for n, p in obj.named_parameters():
                        g = None if grads is None else grads.get(n)
                        p.grad = None if g is None else g.detach().clone().to(p.device)
        except Exception as e:
            raise StateRestoreError(
                f"restoring tracked object {name!r} ({type(obj).__name__}) failed: {e}"
            ) from e


def _owned_copy(obj: Any) -> Any:
    return map_leaves(_same, obj, typed=(torch.Tensor, _clone))


def _clone(t: torch.Tensor) -> torch.Tensor:
    return t.clone()


def _same(obj: Any) -> Any:
    return obj


def _into_optimizer_state(opt: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict whose tensors are the optimizer's own where it already holds state
    of the same shape (a warm-up step, or states initialised eagerly for loading): the snapshot is
    copied into them, no new memory; the rest are copies. ``load_state_dict`` then keeps them."""
    current = opt.state_dict()["state"]
    out = dict(state)
    entries = {}
    for idx, entry in state.get("state", {}).items():
        mine = current.get(idx, {})
        fresh = {}
        for key, value in entry.items():
            have = mine.get(key)
            if (
                isinstance(value, torch.Tensor)
                and isinstance(have, torch.Tensor)
                and (have.shape, have.dtype) == (value.shape, value.dtype)
                and have.is_contiguous()
            ):
                fresh[key] = have.copy_(value)
            else:
                fresh[key] = _owned_copy(value)
        entries[idx] = fresh
    out["state"] = entries
    out["param_groups"] = _owned_copy(state.get("param_groups", []))
    return out
