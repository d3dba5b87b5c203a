"""Bit-for-bit comparison of nested training state (tensors, arrays, dicts, lists, scalars).

What "the run ends where a fault-free run ends" means in tests, the demo and certificates:
every tensor equal in dtype, shape and every bit, every other leaf equal.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def assert_bit_exact(a: Any, b: Any, path: str = "") -> int:
    """Raise AssertionError naming the first differing path; return how many tensors matched."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), f"tensor differs at {path}"
        return 1
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b), path
        return 0
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"keys differ at {path}"
        return sum(assert_bit_exact(a[k], b[k], f"{path}/{k}") for k in a)
    if isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b), path
        return sum(assert_bit_exact(x, y, f"{path}/{i}") for i, (x, y) in enumerate(zip(a, b, strict=True)))
    assert a == b, f"{path}: {a!r} != {b!r}"
    return 0
