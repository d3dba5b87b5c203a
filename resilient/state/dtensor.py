"""DTensor leaves (FSDP2, tensor parallel) as portable local shards, and back onto today's mesh.

A ``DTensor`` holds a reference to its ``DeviceMesh``, and through it to process groups that an
in-process restart destroys and a relaunch never had. So the runtime keeps, for every DTensor leaf
of a tracked object's ``state_dict``, only this rank's local shard and a JSON-able description of
how it was laid out: ``{"__dtensor__": {...}, "local": tensor}``, a plain dict every store of state
already handles (the snapshot ring, the shared-memory mirror, the store copy, checkpoints).
Loading turns each one back into a DTensor on the mesh the *rebuilt* objects live on, found among
the tracked objects' own parameters by its layout (device type, shape, ranks, dimension names).
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from resilient.errors import StateRestoreError
from resilient.state.tree import any_leaf, map_leaves, map_with_path

MARK = "__dtensor__"


def _dtensor_type() -> Any:
    """``DTensor``, if anything imported it (no model can hold one otherwise)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return getattr(mod, "DTensor", None) if mod is not None else None


# a mesh's layout, kept from when its group was alive: a mesh sliced from a bigger one (a 2-D
# mesh's dimension) asks the default group for its ranks, which a recovery has destroyed by the
# time it turns the live state portable (runtime/steps/live.py)
_LAYOUTS: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()


def mesh_layout(mesh: Any) -> dict[str, Any]:
    try:
        known = _LAYOUTS.get(mesh)
    except TypeError:  # (an object that takes no weak reference: nothing kept)
        known = None
    if known is not None:
        return known
    layout = {
        "device_type": mesh.device_type,
        "shape": list(mesh.mesh.shape),
        "ranks": mesh.mesh.flatten().tolist(),
        "dims": list(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
    }
    with contextlib.suppress(TypeError):
        _LAYOUTS[mesh] = layout
    return layout


def remember_meshes(module: torch.nn.Module) -> None:
    """Keep the layouts of the meshes ``module``'s DTensor parameters live on (while their group
    is alive)."""
    dt = _dtensor_type()
    if dt is not None:
        for p in module.parameters():
            if isinstance(p, dt):
                mesh_layout(p.device_mesh)


def placement_to_json(p: Any) -> list[Any]:
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(p, _StridedShard):  # (not a Shard subclass; FSDP2 over tensor parallel uses it)
        return ["strided", p.dim, p.split_factor]
    if isinstance(p, Shard):
        return ["shard", p.dim]
    if isinstance(p, Replicate):
        return ["replicate"]
    if isinstance(p, Partial):
        return ["partial", p.reduce_op]
    raise TypeError(f"DTensor placement {p!r} is not supported")


def placement_from_json(p: list[Any]) -> Any:
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    kind = p[0]
    if kind == "shard":
        return Shard(int(p[1]))
    if kind == "strided":
        return _StridedShard(int(p[1]), split_factor=int(p[2]))
    if kind == "replicate":
        return Replicate()
    if kind == "partial":
        return Partial(str(p[1]))
    raise StateRestoreError(f"unknown DTensor placement {p!r} in the saved state")


def to_portable(tree: Any) -> Any:
    """``tree`` with each DTensor leaf replaced by its local shard and layout (no copy made)."""
    dt = _dtensor_type()
    if dt is None:
        return tree

    def portable(obj: torch.Tensor) -> Any:
        if not isinstance(obj, dt):
            return obj
        spec = {
            "mesh": mesh_layout(obj.device_mesh),
            "placements": [placement_to_json(p) for p in obj.placements],
            "shape": list(obj.shape),
            "stride": list(obj.stride()),
        }
        return {MARK: spec, "local": obj.to_local()}

    return map_leaves(_same, tree, typed=(torch.Tensor, portable))


def _same(obj: Any) -> Any:
    return obj


def _no(obj: Any) -> bool:
    return False


def _is_portable(obj: Any) -> bool:
    return isinstance(obj, dict) and MARK in obj and "local" in obj and len(obj) == 2


def holds_dtensors(tree: Any) -> bool:
    """Whether ``tree`` (a portable state) has any DTensor leaf."""
    return any_leaf(_is_portable, tree, typed=(torch.Tensor, _no), stop=_is_portable)


def _key(layout: dict[str, Any]) -> tuple[Any, ...]:
    dims = layout.get("dims")
    return (
        layout["device_type"],
        tuple(layout["shape"]),
        tuple(layout["ranks"]),
        tuple(dims) if dims else None,
    )


def live_meshes(objects: Iterable[Any]) -> dict[tuple[Any, ...], Any]:
    """The device meshes the given (rebuilt) objects' DTensors live on, by layout."""
    dt = _dtensor_type()
    found: dict[tuple[Any, ...], Any] = {}
    if dt is None:
        return found

    def tensors(obj: Any) -> Iterator[Any]:
        if isinstance(obj, torch.nn.Module):
            yield from obj.parameters()
            yield from obj.buffers()
        elif isinstance(obj, torch.optim.Optimizer):
            for group in obj.param_groups:
                yield from group["params"]

    for obj in objects:
        for t in tensors(obj):
            if isinstance(t, dt):
                mesh = t.device_mesh
                found.setdefault(_key(mesh_layout(mesh)), mesh)
                # a 2-D mesh's 1-D parts (a tensor-parallel plan may keep state on one of them)
                if mesh.ndim > 1 and mesh.mesh_dim_names:
                    for name in mesh.mesh_dim_names:
                        try:
                            sub = mesh[name]
                        except Exception:  # (a mesh that cannot be sliced by this name)
                            continue
                        found.setdefault(_key(mesh_layout(sub)), sub)
    return found


def from_portable(tree: Any, meshes: dict[tuple[Any, ...], Any], where: str) -> Any:
    """``tree`` with each portable leaf turned back into a DTensor on the matching live mesh."""
    if not holds_dtensors(tree):
        return tree
    from torch.distributed.tensor import DTensor

    def restore(obj: Any, path: str) -> Any:
        if not _is_portable(obj):
            return obj
        spec = obj[MARK]
        mesh = meshes.get(_key(spec["mesh"]))
        if mesh is None:
            raise StateRestoreError(
                f"{where}{path}: saved as a DTensor on the device mesh {spec['mesh']}, but no tracked "
                f"object lives on such a mesh now (meshes found: {[list(k) for k in meshes] or 'none'}); "
                "track the model (and its optimizer) built on the same mesh"
            )
        return DTensor.from_local(
            obj["local"],
            mesh,
            [placement_from_json(p) for p in spec["placements"]],
            run_check=False,
            shape=torch.Size(spec["shape"]),
            stride=tuple(spec["stride"]),
        )

    return map_with_path(restore, tree, stop=_is_portable)
