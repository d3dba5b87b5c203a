"""Values a training loop carries from one step to the next outside any object with a
``state_dict``: a batch prefetched at the end of a step for the next one, a best validation
loss, an EMA tensor, a token counter. ``ctx.carry(batch=None, best_val_loss=1e9)`` returns a
:class:`Carried`; its fields are read and set as attributes, and it is tracked like a model:
snapshotted with the rest, restored with the rest, so that the function, entered again after a
fault, finds the values of the step it resumes at instead of what its top level computes afresh.

A field holds a tensor, an array, a number, a string, bytes, ``None``, or dicts (string keys),
lists and tuples of those: what a snapshot and a checkpoint keep exactly. Anything else is
refused when it is set, naming the field. A live resume keeps the carried tensors by reference
(a carried value is usually replaced, not changed in place): a tensor changed in place since the
step began makes the rank fall back to a snapshot, like a parameter would.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

CARRY = "carry"  # the name it is tracked under (events, snapshots, checkpoints)
_PLAIN = (int, float, bool, str, bytes, type(None), np.generic)


class Carried:
    """The carried values of a training function (see the module docstring)."""

    __slots__ = ("_values",)

    def __init__(self, **values: Any) -> None:
        object.__setattr__(self, "_values", {})
        for name, value in values.items():
            setattr(self, name, value)

    def __getattr__(self, name: str) -> Any:
        values = object.__getattribute__(self, "_values")
        try:
            return values[name]
        except KeyError:
            raise AttributeError(
                f"ctx.carry has no field {name!r} (it has {sorted(values)}): name it in ctx.carry(...) "
                "or set it first"
            ) from None

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            raise AttributeError(f"ctx.carry field {name!r}: names starting with '_' are reserved")
        _check(value, f"ctx.carry.{name}")
        self._values[name] = value

    def __delattr__(self, name: str) -> None:
        self._values.pop(name, None)

    def __contains__(self, name: str) -> bool:
        return name in self._values

    def __repr__(self) -> str:
        return f"Carried({', '.join(self._values)})"

    def fields(self) -> dict[str, Any]:
        """The fields as they are now (the values themselves, not copies)."""
        return dict(self._values)

    def state_dict(self) -> dict[str, Any]:
        """The fields, their containers rebuilt and arrays copied: a snapshot is not changed by
        later in-place edits of a carried dict or list (tensors are copied by whoever keeps it)."""
        return {k: by_reference(v) for k, v in self._values.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict):
            raise TypeError(
                f"ctx.carry: a restored state must be a dict of fields, got {type(state).__name__}"
            )
        self._values.clear()
        for name, value in state.items():
            setattr(self, name, value)


def by_reference(value: Any) -> Any:
    """``value`` with its containers rebuilt and arrays copied, its tensors the same objects."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, dict):
        return {k: by_reference(v) for k, v in value.items()}
    if isinstance(value, list):
        return [by_reference(v) for v in value]
    if isinstance(value, tuple):
        return tuple(by_reference(v) for v in value)
    if isinstance(value, np.ndarray):
        return value.copy()
    return value


def tensors_of(value: Any) -> list[torch.Tensor]:
    """Every tensor in ``value``, in a fixed order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_of(v)]
    if isinstance(value, list | tuple):
        return [t for v in value for t in tensors_of(v)]
    return []


def _check(value: Any, where: str) -> None:
    if isinstance(value, (torch.Tensor, np.ndarray, *_PLAIN)):
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"{where}: a carried dict's keys are strings, got {type(k).__name__} {k!r}")
            _check(v, f"{where}[{k!r}]")
        return
    if type(value) in (list, tuple):  # (not a namedtuple: its fields are not rebuilt from a tuple)
        for i, v in enumerate(value):
            _check(v, f"{where}[{i}]")
        return
    raise TypeError(
        f"{where}: cannot carry a {type(value).__name__}: a field holds tensors, arrays, numbers, "
        "strings, bytes, None, or dicts, lists and tuples of those; an object with "
        "state_dict()/load_state_dict() is tracked with ctx.track(name=obj)"
    )
