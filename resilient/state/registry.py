"""The registry of tracked state: user objects with ``state_dict``/``load_state_dict`` and every RNG.

Objects are tracked by name. ``torch.Generator`` (a common data-order source) is supported through
its ``get_state``/``set_state``. RNG state covers Python ``random``, NumPy's global generator, torch
CPU and, when CUDA is initialized, every CUDA device.
"""

from __future__ import annotations

import random
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch.utils.data import DataLoader

from resilient.errors import SnapshotError, StateRestoreError
from resilient.state import dtensor
from resilient.state.loader import make_resumable
from resilient.state.snapshot import Frozen

RNG = "__rng__"
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

    def __contains__(self, name: str) -> bool:
        return name in self._objects

    def names(self) -> list[str]:
        return list(self._objects)

    def objects(self) -> list[Any]:
        return list(self._objects.values())

    def add(self, name: str, obj: Any) -> None:
        if name == RNG:
            raise ValueError(f"{RNG!r} is reserved for the RNG state")
        if isinstance(obj, DataLoader) and not isinstance(obj, Stateful):
            make_resumable(obj)  # a plain DataLoader: its position becomes state (state/loader.py)
        if not isinstance(obj, torch.Generator | Stateful):
            raise TypeError(
                f"cannot track {name}={type(obj).__name__}: it needs state_dict()/load_state_dict() "
                "(or be a torch.Generator)"
            )
        self._objects[name] = obj

    def clear(self) -> None:
        self._objects.clear()

    def capture(self) -> dict[str, Any]:
        """The current state of every tracked object plus the RNGs (tensors are not copied here)."""
        out: dict[str, Any] = {}
        for name, obj in self._objects.items():
            try:
                out[name] = (
                    {"generator": obj.get_state()}
                    if isinstance(obj, torch.Generator)
                    else dtensor.to_portable(obj.state_dict())
                )
            except Exception as e:
                what = f"tracked object {name!r} ({type(obj).__name__})"
                raise SnapshotError(f"{what}: state_dict() failed: {type(e).__name__}: {e}") from e
        out[RNG] = capture_rng()
        return out

    def load(self, name: str, state: Any) -> None:
        obj = self._objects[name]
        if dtensor.holds_dtensors(state):  # back onto the mesh the rebuilt objects live on
            state = dtensor.from_portable(state, dtensor.live_meshes(self._objects.values()), name)
        try:
            if isinstance(obj, torch.Generator):
                obj.set_state(state["generator"])
            else:
                obj.load_state_dict(state)
        except Exception as e:
            raise StateRestoreError(
                f"restoring tracked object {name!r} ({type(obj).__name__}) failed: {e}"
            ) from e
