"""Cheap fingerprints of an object's state, to tell whether it changed between two steps.

A fingerprint is a hashable value equal for equal states and (almost surely) different otherwise,
taken without copying the state: a float64 sum per tensor (one transfer to the host per device;
small CPU tensors and arrays are hashed byte for byte), a generator's state hashed, a module's or
an optimizer's tensors summed one by one, a list's or dict's length and the ends of its shallow
contents. A change that keeps every sum exactly equal (a permutation of a large tensor) is missed.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable, Sequence
from itertools import chain
from typing import Any

import numpy as np
import torch
import xxhash
from torch.utils.data import dataloader as _dataloader

SMALL = 1 << 16  # elements: a CPU tensor or array up to this size is hashed byte for byte
_ENDS = 32  # a list's or dict's first and last items are looked at, not all of them
PRIMITIVE = (bool, int, float, complex, str, bytes, type(None), np.generic)
# torch's DataLoader iterators: their position is ``_num_yielded`` (the class is private).
LOADER_ITERS = tuple(t for t in [getattr(_dataloader, "_BaseDataLoaderIter", None)] if isinstance(t, type))


def fingerprint(value: Any, skip: Callable[[Any], bool]) -> Hashable | None:
    """A cheap fingerprint of ``value``'s state; None where it has none to take. ``skip``: tensors
    not to count (a wrapper module's tracked parameters)."""
    if value is None or isinstance(value, bool | int | str | bytes):
        return value
    if isinstance(value, float):
        return value.hex()  # NaN equals itself this way
    if isinstance(value, np.generic | np.ndarray):
        return _array_state(np.asarray(value))
    if isinstance(value, torch.Tensor):
        return _sums([value]) if value.numel() > SMALL or value.device.type != "cpu" else _bytes(value)
    if isinstance(value, torch.Generator):
        return _digest(value.get_state().numpy().tobytes())
    if isinstance(value, random.Random):
        return hash(value.getstate())
    if isinstance(value, np.random.Generator):
        return _digest(repr(_plain(value.bit_generator.state)).encode())
    if isinstance(value, np.random.RandomState):
        return _digest(repr(_plain(value.get_state(legacy=False))).encode())
    if isinstance(value, torch.nn.Module):
        return _sums([t for t in chain(value.parameters(), value.buffers()) if not skip(t)])
    if isinstance(value, torch.optim.Optimizer):
        return _optimizer_state(value, skip)
    if isinstance(value, LOADER_ITERS):
        return getattr(value, "_num_yielded", None)
    if isinstance(value, list | tuple | dict | set | frozenset):
        return _container_state(value, skip)
    return None


def _digest(data: bytes) -> int:
    return xxhash.xxh3_64_intdigest(data)


def _plain(value: Any) -> Any:
    """An RNG state (dicts, tuples, arrays) with its arrays as digests, for a full ``repr``."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return _digest(value.tobytes()) if isinstance(value, np.ndarray) else value


def _array_state(a: np.ndarray) -> Hashable | None:
    if a.dtype == object:
        return None
    if a.size <= SMALL:
        return (a.shape, a.dtype.str, _digest(np.ascontiguousarray(a).tobytes()))
    return (a.shape, a.dtype.str, float(a.sum(dtype=np.float64)).hex())


def _bytes(t: torch.Tensor) -> Hashable:
    flat = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return (tuple(t.shape), str(t.dtype), _digest(flat.view(torch.uint8).numpy().tobytes()))


def _sums(tensors: Sequence[torch.Tensor]) -> Hashable | None:
    """Each tensor's float64 sum, one transfer to the host per device."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        if t.layout == torch.strided and t.device.type != "meta" and not t.is_complex():
            by_device.setdefault(t.device, []).append(t.detach())
    sums: list[str] = []
    for group in by_device.values():
        stacked = torch.stack([t.sum(dtype=torch.float64) for t in group])
        sums += [float(v).hex() for v in stacked.tolist()]
    shapes = tuple(tuple(t.shape) for group in by_device.values() for t in group)
    return (shapes, tuple(sums)) if sums else None


def _optimizer_state(opt: torch.optim.Optimizer, skip: Callable[[Any], bool]) -> Hashable:
    """Its state tensors' sums, and its other state: empty before its first step, not None."""
    tensors: list[torch.Tensor] = []
    plain: list[Hashable] = []
    for per_param in opt.state.values():
        for value in per_param.values():
            if isinstance(value, torch.Tensor):
                tensors += [] if skip(value) else [value]
            else:
                plain.append(fingerprint(value, skip))
    return (_sums(tensors), tuple(plain))


def _container_state(value: Any, skip: Callable[[Any], bool]) -> Hashable:
    """Length and shallow contents of the ends: an item by value if it has one, else by identity."""
    if isinstance(value, set | frozenset):
        return ("set", len(value))
    items = list(value.items()) if isinstance(value, dict) else list(value)
    ends = items if len(items) <= 2 * _ENDS else items[:_ENDS] + items[-_ENDS:]
    return (type(value).__name__, len(items), tuple(_item(v, skip) for v in ends))


def _item(value: Any, skip: Callable[[Any], bool]) -> Hashable:
    if isinstance(value, tuple) and len(value) == 2:  # a dict's (key, value)
        return (_item(value[0], skip), _item(value[1], skip))
    if isinstance(value, (*PRIMITIVE, torch.Tensor, np.ndarray)):
        return fingerprint(value, skip)
    return ("id", id(value))
