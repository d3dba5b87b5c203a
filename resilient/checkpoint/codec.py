"""State trees to (JSON skeleton, tensors) and back, so that nothing in a checkpoint is pickled.

A ``state_dict`` tree (nested dicts, lists, tuples; optimizer states keyed by int; RNG states made
of tuples and NumPy arrays) becomes a JSON skeleton with tagged nodes plus a flat list of tensors
keyed by their path in the tree. Loading a checkpoint then parses JSON and views raw bytes: no
``pickle``, no ``torch.load`` of untrusted data, no code execution from a file.

Tags (every container is a one-key object; scalars are plain JSON):
``{"d": {...}}`` dict with str keys, ``{"D": [[k, v], ...]}`` dict with other keys, ``{"l": [...]}``
list, ``{"t": [...]}`` tuple, ``{"T": i}`` tensor i, ``{"a": i}`` NumPy array stored as tensor i,
``{"dt": "float32"}`` a torch dtype, ``{"b": base64}`` bytes.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from resilient.errors import CheckpointError
from resilient.state.snapshot import Frozen
from resilient.state.tree import map_with_path

_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.complex64,
        torch.complex128,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.uint16,
        torch.uint32,
        torch.uint64,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    )
}


def itemsize(name: str) -> int:
    """Bytes per element of a checkpoint dtype name (ValueError for a name not on the list)."""
    if name not in _DTYPES:
        raise ValueError(f"dtype {name!r} is not one a checkpoint holds ({', '.join(sorted(_DTYPES))})")
    return _DTYPES[name].itemsize


def check_layout(
    layout: Any, size: int, where: str, *, keyed: bool = False
) -> list[tuple[str, tuple[int, ...], int, int]]:
    """The (dtype, shape, offset, nbytes) entries of a packed buffer of ``size`` bytes, each checked
    before anything is allocated: a known dtype, a shape of non-negative whole numbers, its bytes
    equal to shape times the dtype's size, inside the buffer. (``keyed``: each entry starts with
    its key.) Raises :class:`CheckpointError` naming ``where`` and the entry's field."""
    if not isinstance(layout, list):
        raise CheckpointError(f"{where}: field layout: a {type(layout).__name__}, not a list")
    out = []
    for i, entry in enumerate(layout):
        at = f"{where}: field layout[{i}]"
        if not isinstance(entry, list) or len(entry) != (5 if keyed else 4):
            raise CheckpointError(f"{at}: {str(entry)[:80]} is not an entry")
        dtype, shape, offset, nbytes = entry[1:] if keyed else entry
        try:
            size_of = itemsize(dtype if isinstance(dtype, str) else repr(dtype))  # (repr: named, refused)
        except ValueError as e:
            raise CheckpointError(f"{at}.dtype: {e}") from None
        if not isinstance(shape, list) or any(type(d) is not int or d < 0 for d in shape):
            raise CheckpointError(
                f"{at}.shape: {str(shape)[:80]} is not a list of non-negative whole numbers"
            )
        for name, v in (("offset", offset), ("nbytes", nbytes)):
            if type(v) is not int or v < 0:
                raise CheckpointError(f"{at}.{name}: {v!r} is not a non-negative whole number")
        n = size_of
        for d in shape:
            n *= d
        if n != nbytes:
            raise CheckpointError(f"{at}.nbytes: {nbytes}, but shape {shape} of {dtype} is {n} bytes")
        if offset + nbytes > size:
            raise CheckpointError(
                f"{at}.offset: bytes {offset}..{offset + nbytes} run past the {size} there are"
            )
        out.append((dtype, tuple(shape), offset, nbytes))
    return out


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise CheckpointError(f"tensor dtype {dtype} is not supported in checkpoints")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise CheckpointError(f"unknown tensor dtype {name!r} in checkpoint") from None


@dataclass(frozen=True)
class Leaf:
    """A tensor of the tree, with the path that names it across checkpoints (for incremental saves)."""

    key: str
    tensor: torch.Tensor


def encode(tree: Any) -> tuple[Any, list[Leaf]]:
    """Split ``tree`` into a JSON-able skeleton and its tensor leaves (not copied)."""
    leaves: list[Leaf] = []

    def node(obj: Any, path: str) -> Any:
        return map_with_path(leaf, obj, path, typed=(torch.Tensor, tensor), wrap=tag)

    def tensor(obj: torch.Tensor, path: str) -> Any:
        if obj.is_sparse or obj.is_quantized or obj.is_nested:
            raise CheckpointError(f"cannot checkpoint {path or '/'}: sparse/quantized/nested tensor")
        if type(obj) is not torch.Tensor and not isinstance(obj, torch.nn.Parameter):
            raise CheckpointError(
                f"cannot checkpoint {path or '/'}: {type(obj).__name__} (sharded tensors go through "
                "resilient.checkpoint.sharded)"
            )
        dtype_name(obj.dtype)
        leaves.append(Leaf(path, obj.detach()))
        return {"T": len(leaves) - 1}

    def leaf(obj: Any, path: str) -> Any:
        if obj is None or isinstance(obj, bool | int | float | str):
            return obj
        if isinstance(obj, Frozen):
            return node(obj.value, path)
        if isinstance(obj, np.ndarray):
            leaves.append(Leaf(path, torch.from_numpy(np.ascontiguousarray(obj))))
            return {"a": len(leaves) - 1}
        if isinstance(obj, np.generic):
            return node(obj.item(), path)
        if isinstance(obj, torch.dtype):
            return {"dt": dtype_name(obj)}
        if isinstance(obj, bytes):
            return {"b": base64.b64encode(obj).decode()}
        raise CheckpointError(
            f"cannot checkpoint {path or '/'}: {type(obj).__name__} is not a tensor, array, number, "
            "string, bytes, dtype or container of those"
        )

    def tag(obj: Any, out: Any, path: str) -> Any:
        if isinstance(obj, dict):
            if all(isinstance(k, str) for k in obj):
                return {"d": out}
            # (keys are encoded after the values: only a tensor used as a key would notice)
            return {"D": [[node(k, f"{path}/<key>"), v] for k, v in out.items()]}
        return {"l": out} if isinstance(obj, list) else {"t": list(out)}

    return node(tree, ""), leaves


def decode(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """Rebuild the tree from its skeleton and the tensors in leaf order."""

    def walk(node: Any) -> Any:
        if node is None or isinstance(node, bool | int | float | str):
            return node
        if not isinstance(node, dict) or len(node) != 1:
            raise CheckpointError(f"malformed checkpoint skeleton node: {str(node)[:80]}")
        ((tag, v),) = node.items()
        if tag == "d":
            return {k: walk(x) for k, x in v.items()}
        if tag == "D":
            return {walk(k): walk(x) for k, x in v}
        if tag == "l":
            return [walk(x) for x in v]
        if tag == "t":
            return tuple(walk(x) for x in v)
        if tag == "T":
            return tensors[_index(v)]
        if tag == "a":
            return tensors[_index(v)].numpy().copy()
        if tag == "dt":
            return dtype_from_name(v)
        if tag == "b":
            return base64.b64decode(v)
        raise CheckpointError(f"unknown checkpoint skeleton tag {tag!r}")

    def _index(v: Any) -> int:
        if type(v) is not int or not 0 <= v < len(tensors):
            raise CheckpointError(f"skeleton refers to tensor {v!r}; there are {len(tensors)}")
        return v

    try:
        return walk(skeleton)
    except CheckpointError:
        raise
    except (AttributeError, TypeError, ValueError, KeyError, RecursionError) as e:
        raise CheckpointError(f"malformed checkpoint skeleton: {type(e).__name__}: {e}") from None
