"""Exact digests of tensor state, computed where the tensors live, and the replica groups they
are compared in (silent data corruption: a flipped bit in one rank's replica of the weights).

A tensor's digest is the sum of its bytes read as the widest integer type that divides its size
(``int64`` where it can), summed in ``int64``: exact, the same in any order and on any device,
and a single flipped bit changes it (a bit ``j`` of a ``w``-bit word moves the word by ``±2**j``
with ``j < w <= 64``, never ``0`` modulo ``2**64``). The sums are taken on the tensors' own device,
stacked, and cross to the host once per device; the host hashes them with the paths, dtypes and
shapes (``blake2b``). No copy of the state is made.

What is replicated (and so must be equal on several ranks):

- the parameters (not the buffers: BatchNorm statistics differ per rank after a forward) of a
  tracked ``DistributedDataParallel``: across its process group;
- the state of a tracked optimizer whose parameters all belong to such models: across the same group;
- a DTensor leaf (FSDP2 with HSDP, tensor parallel): across the ranks whose mesh coordinates equal
  this rank's on every dimension that is not ``Replicate`` (HSDP's replicate dimension, a
  replicated tensor-parallel parameter). A DTensor sharded on every mesh dimension (1-D FSDP) has
  no replica, and nothing to compare it with.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from resilient.state.dtensor import MARK
from resilient.state.tree import map_with_path

# (int sum, dtype, shape) of one tensor leaf
Leaf = tuple[int, str, tuple[int, ...]]
Group = tuple[int, ...]  # the global ranks that hold one replica each, sorted

_WIDTHS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def _as_words(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as one flat tensor of the widest integer type that divides their count."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)  # (bool, complex and float8 included: any element size)
    n = flat.numel()
    for width, dtype in _WIDTHS:
        if n % width == 0:
            return flat.view(dtype) if width > 1 else flat
    raise AssertionError("unreachable: every size divides by 1")


def tensor_sums(tensors: Sequence[torch.Tensor]) -> list[int]:
    """The exact integer sum of each tensor's bytes, one transfer to the host per device."""
    out: list[int] = [0] * len(tensors)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    for idx in by_device.values():
        sums = torch.stack([torch.sum(_as_words(tensors[i]), dtype=torch.int64) for i in idx])
        for i, v in zip(idx, sums.tolist(), strict=True):
            out[i] = int(v)
    return out


def leaf_sums(state: Any) -> dict[str, Leaf]:
    """Every tensor leaf of ``state`` (a captured state: DTensors already portable), by path."""
    paths: list[str] = []
    tensors: list[torch.Tensor] = []

    def take(t: torch.Tensor, path: str) -> None:
        paths.append(path)
        tensors.append(t)

    map_with_path(lambda obj, path: None, state, typed=(torch.Tensor, take))
    sums = tensor_sums(tensors)
    return {
        p: (s, str(t.dtype).removeprefix("torch."), tuple(t.shape))
        for p, t, s in zip(paths, tensors, sums, strict=True)
    }


def digest(leaves: Iterable[tuple[str, Leaf]]) -> str:
    """One hex digest of ``(path, leaf)`` pairs (sorted here: the order they come in does not count)."""
    h = hashlib.blake2b(digest_size=12)
    for path, (total, dtype, shape) in sorted(leaves):
        h.update(f"{path}\x00{dtype}\x00{shape}\x00{total & 0xFFFFFFFFFFFFFFFF:x}\n".encode())
    return h.hexdigest()


# -- which leaves are replicated where ------------------------------------------------------------------
def dtensor_group(spec: Mapping[str, Any], rank: int) -> Group:
    """The ranks holding the same local tensor as ``rank`` for a DTensor laid out as ``spec`` (a
    portable DTensor's description): those whose coordinates equal ``rank``'s on every mesh
    dimension that is not ``Replicate`` (a ``Shard``, a ``Partial``: each rank's own part)."""
    shape = [int(n) for n in spec["mesh"]["shape"]]
    ranks = [int(r) for r in spec["mesh"]["ranks"]]
    if rank not in ranks:
        return (rank,)
    coords = [_coords(i, shape) for i in range(len(ranks))]
    mine = coords[ranks.index(rank)]
    fixed = [d for d, p in enumerate(spec["placements"]) if p[0] != "replicate"]
    return tuple(sorted(r for r, c in zip(ranks, coords, strict=True) if all(c[d] == mine[d] for d in fixed)))


def _coords(i: int, shape: Sequence[int]) -> tuple[int, ...]:
    out = []
    for n in reversed(shape):
        out.append(i % n)
        i //= n
    return tuple(reversed(out))


def _ddp_group(ddp: Any, world: int) -> Group:
    import torch.distributed as dist

    try:
        return tuple(sorted(dist.get_process_group_ranks(ddp.process_group)))
    except (RuntimeError, ValueError, AttributeError):  # (no group: a DDP outside a run, in a test)
        return tuple(range(world))


def replica_sets(
    state: Mapping[str, Any], objects: Mapping[str, Any], rank: int, world: int
) -> dict[Group, list[str]]:
    """The paths of ``state``'s replicated tensor leaves (see the module docstring), by the group
    of ranks that hold them; groups of one rank are left out (nothing to compare with)."""
    from torch.nn.parallel import DistributedDataParallel

    out: dict[Group, list[str]] = {}
    owner: dict[int, Group] = {}  # id(parameter) -> its DDP's group
    for name, obj in objects.items():
        if isinstance(obj, DistributedDataParallel):
            group = _ddp_group(obj, world)
            params = dict(obj.named_parameters())
            for p in params.values():
                owner[id(p)] = group
            tree = state.get(name, {})
            paths = [f"/{name}/{k}" for k, v in tree.items() if k in params and isinstance(v, torch.Tensor)]
            out.setdefault(group, []).extend(paths)
    for name, obj in objects.items():
        if isinstance(obj, torch.optim.Optimizer):
            groups = {owner.get(id(p)) for g in obj.param_groups for p in g["params"]}
            shared = groups.pop() if len(groups) == 1 else None
            if shared is not None:
                out.setdefault(shared, []).extend(
                    _tensor_paths(state.get(name, {}).get("state", {}), f"/{name}/state")
                )
    # DTensor leaves anywhere (a DDP's state holds none)
    for name, tree in state.items():

        def portable(obj: Any, path: str) -> None:
            if _is_portable(obj):
                group = dtensor_group(obj[MARK], rank)
                out.setdefault(group, []).append(f"{path}/local")

        map_with_path(portable, tree, f"/{name}", stop=_is_portable)
    return {g: sorted(set(p)) for g, p in out.items() if len(g) > 1 and p}


def _tensor_paths(tree: Any, root: str) -> list[str]:
    found: list[str] = []
    map_with_path(lambda o, p: None, tree, root, typed=(torch.Tensor, lambda t, p: found.append(p)))
    return found


def _is_portable(obj: Any) -> bool:
    return isinstance(obj, dict) and MARK in obj and "local" in obj and len(obj) == 2


def next_member(group: Group, rank: int) -> int:
    """The member ``rank`` compares its digest with: the next one around the group (equal pairs
    around a cycle mean equal everywhere)."""
    return group[(group.index(rank) + 1) % len(group)]


def group_id(group: Group) -> str:
    """A short name of a group, the same on every rank (posted with each digest)."""
    return hashlib.blake2b(",".join(map(str, group)).encode(), digest_size=4).hexdigest()


def span(group: Group) -> str:
    """A group of ranks in a message: a range when it is one."""
    if len(group) > 2 and list(group) == list(range(group[0], group[-1] + 1)):
        return f"{group[0]}-{group[-1]}"
    return ",".join(map(str, group))
