"""Loading a checkpoint that a different number of ranks wrote (the job shrank or grew).

DTensor leaves (FSDP2, HSDP, tensor parallel) are saved as each rank's local shard plus its layout
(:mod:`resilient.state.dtensor`): the global shape, the placements, and the mesh's shape and
ranks. From the layout alone the global indices a rank held along each dimension follow: every
placement splits an index vector the way it splits the tensor (its own ``_split_tensor``), mesh
dimension by mesh dimension, left to right, as DTensor does. A new rank computes the same for its
place on today's mesh, reads only the old shards that overlap its new one (each tensor read is
checked against its checksum) and copies the overlap. A layout that cannot be resharded raises
:class:`StateRestoreError` (the checkpoint is fine: no fallback to an older one, no quarantine).
This is what DCP's load planner does; here it reads the runtime's own per-rank files, so a save
never waits for a collective DCP write.

Objects without DTensor leaves: when every old rank saved identical bytes (data-parallel replicas:
a DDP model, its optimizer, a scheduler), the copy is exact. Per-rank objects (RNG states, a data
position) cannot be split or merged; new rank ``r`` takes old rank ``r % old_world``'s, and the
caller is told which objects those were.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from resilient.checkpoint.codec import decode, dtype_from_name
from resilient.checkpoint.manifest import Manifest, RankEntry, TensorEntry
from resilient.errors import CheckpointError, StateRestoreError
from resilient.state.dtensor import MARK, mesh_layout, placement_from_json

Indices = list[torch.Tensor]  # per tensor dimension, the sorted global indices a rank holds
# (root, entry) -> the tensor, read and checked against its checksum: the loader's own read
ReadTensor = Callable[[Path, TensorEntry], torch.Tensor]


def held_indices(spec: dict[str, Any], rank: int) -> Indices | None:
    """The global indices along each dimension that global ``rank`` holds of a DTensor laid out
    as ``spec`` (a portable leaf's layout), or None if ``rank`` is not on its mesh."""
    mesh = spec["mesh"]
    if rank not in mesh["ranks"]:
        return None
    flat = mesh["ranks"].index(rank)
    coords = []
    for size in reversed(mesh["shape"]):
        coords.append(flat % size)
        flat //= size
    coords.reverse()
    idx = [torch.arange(n) for n in spec["shape"]]
    for size, coord, p in zip(mesh["shape"], coords, spec["placements"], strict=True):
        if p[0] == "partial":
            raise StateRestoreError("a DTensor with a Partial placement (an unreduced sum) cannot reshard")
        if p[0] in ("shard", "strided"):
            d = int(p[1])  # the same placement, on the one dimension of that dimension's index vector
            along = placement_from_json([p[0], 0, *p[2:]])
            idx[d] = along._split_tensor(idx[d], size, with_padding=False)[0][coord]
    return idx


def _portable_leaves(node: Any, path: str, out: dict[str, tuple[dict[str, Any], int]]) -> None:
    """Portable DTensor leaves of an encoded skeleton: path -> (layout, index of its local tensor)."""
    if not isinstance(node, dict) or len(node) != 1:
        return
    ((tag, v),) = node.items()
    if tag == "d":
        if set(v) == {MARK, "local"} and isinstance(v["local"], dict) and "T" in v["local"]:
            out[path] = (decode(v[MARK], []), int(v["local"]["T"]))
            return
        for k, x in v.items():
            _portable_leaves(x, f"{path}/{k}", out)
    elif tag == "D":
        for k, x in v:  # (a non-str key, e.g. an optimizer's parameter index, as JSON)
            _portable_leaves(x, f"{path}/{k if isinstance(k, str) else json.dumps(k)}", out)
    elif tag in ("l", "t"):
        for i, x in enumerate(v):
            _portable_leaves(x, f"{path}/{i}", out)


def _is_range(pos: torch.Tensor) -> bool:
    return pos.numel() == 0 or int(pos[-1] - pos[0]) + 1 == pos.numel()


def _copy_overlap(dst: torch.Tensor, dst_idx: Indices, src: torch.Tensor, src_idx: Indices) -> int:
    """Copy the elements both index sets hold from ``src`` into ``dst``; returns how many."""
    dst_pos, src_pos = [], []
    for want, have in zip(dst_idx, src_idx, strict=True):
        common = want[torch.isin(want, have)]
        if common.numel() == 0:
            return 0
        dst_pos.append(torch.searchsorted(want, common))
        src_pos.append(torch.searchsorted(have, common))
    block = src
    for d, pos in enumerate(src_pos):
        block = block.narrow(d, int(pos[0]), pos.numel()) if _is_range(pos) else block.index_select(d, pos)
    target = dst
    scattered = []
    for d, pos in enumerate(dst_pos):
        if _is_range(pos):
            target = target.narrow(d, int(pos[0]), pos.numel())
        else:
            scattered.append(d)
    if not scattered:
        target.copy_(block)
    elif len(scattered) == 1:
        target.index_copy_(scattered[0], dst_pos[scattered[0]], block)
    else:  # (two sharded dimensions both interleaved: index every element)
        grids = torch.meshgrid(
            *[dst_pos[d] if d in scattered else torch.arange(target.shape[d]) for d in range(target.dim())],
            indexing="ij",
        )
        target.index_put_(grids, block)
    return block.numel()


class _OldRanks:
    """The old ranks' entries of one checkpoint, their tensors read (and verified) on demand."""

    def __init__(self, root: Path, manifest: Manifest, read: ReadTensor) -> None:
        self.root = root
        self._read = read
        self.entries: dict[int, RankEntry] = {e.rank: e for e in manifest.ranks}
        self.leaves: dict[int, dict[str, tuple[dict[str, Any], int]]] = {}
        for q, e in self.entries.items():
            found: dict[str, tuple[dict[str, Any], int]] = {}
            _portable_leaves(e.skeleton, "", found)
            self.leaves[q] = found

    def tensor(self, q: int, i: int) -> torch.Tensor:
        return self._read(self.root, self.entries[q].tensors[i])

    def state(self, q: int) -> Any:
        entry = self.entries[q]
        return decode(entry.skeleton, [self.tensor(q, i) for i in range(len(entry.tensors))])

    def same_on_every_rank(self, name: str) -> bool:
        """Whether every old rank saved object ``name`` with identical skeleton and bytes."""
        prefix = f"/{name}/"

        def fingerprint(e: RankEntry) -> tuple[str, list[tuple[str, str]]]:
            node = e.skeleton["d"].get(name)
            return json.dumps(node, sort_keys=True), [
                (t.key, t.xxh3) for t in e.tensors if t.key.startswith(prefix) or t.key == f"/{name}"
            ]

        prints = {json.dumps(fingerprint(e)) for e in self.entries.values()}
        return len(prints) == 1


def reshard_rank(
    root: Path, path: Path, manifest: Manifest, rank: int, meshes: list[Any], read: ReadTensor
) -> tuple[dict[str, Any], dict[str, int]]:
    """New ``rank``'s state (portable form, onto ``meshes``, today's) from a checkpoint written at
    another world size, and the per-rank objects taken from an old rank (name -> old rank).

    ``read`` reads one old tensor (the loader's ``read_tensor``, passed in so that this module
    and the loader do not import each other)."""
    old = _OldRanks(root, manifest, read)
    base = rank % manifest.world_size
    state = old.state(base)
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: rank {base}'s state is not a dict of tracked objects")
    for leaf_path, (spec, _i) in old.leaves[base].items():
        _set(state, leaf_path, _reshard_leaf(old, leaf_path, spec, rank, meshes, path))
    per_rank: dict[str, int] = {}
    for name in state:
        if not any(p.startswith(f"/{name}/") for p in old.leaves[base]) and not old.same_on_every_rank(name):
            per_rank[name] = base
    return state, per_rank


def _reshard_leaf(
    old: _OldRanks, leaf_path: str, spec: dict[str, Any], rank: int, meshes: list[Any], path: Path
) -> dict[str, Any]:
    mesh = _matching_mesh(spec["mesh"], meshes)
    if mesh is None:
        raise StateRestoreError(
            f"{path}: {leaf_path} was saved on a {len(spec['mesh']['shape'])}-D "
            f"{spec['mesh']['device_type']} mesh (dims {spec['mesh'].get('dims')}), and no tracked "
            "object lives on such a mesh now"
        )
    new_spec = {**spec, "mesh": mesh_layout(mesh)}
    want = held_indices(new_spec, rank)
    if want is None:
        raise StateRestoreError(f"{path}: rank {rank} is not on the mesh of {leaf_path} ({new_spec['mesh']})")
    first = min(q for q in old.entries if leaf_path in old.leaves[q])
    entry = old.entries[first].tensors[old.leaves[first][leaf_path][1]]
    local = torch.empty([len(w) for w in want], dtype=dtype_from_name(entry.dtype))
    covered = 0
    seen: list[Indices] = []
    for q in sorted(old.entries):
        got = old.leaves[q].get(leaf_path)
        if got is None:
            continue
        q_spec, i = got
        have = held_indices(q_spec, q)
        if have is None or any(all(torch.equal(a, b) for a, b in zip(have, s, strict=True)) for s in seen):
            continue  # a replica of a shard already copied
        seen.append(have)
        if all(torch.isin(w, h).any() for w, h in zip(want, have, strict=True)):
            covered += _copy_overlap(local, want, old.tensor(q, i), have)
    if covered != local.numel():
        raise StateRestoreError(
            f"{path}: {leaf_path}: the old ranks' shards cover {covered} of the {local.numel()} elements "
            f"rank {rank} needs (layout {spec})"
        )
    return {MARK: new_spec, "local": local}


def _matching_mesh(saved: dict[str, Any], meshes: list[Any]) -> Any:
    """Today's mesh for a leaf saved on ``saved``: same device type, dimensions and their names
    (the sizes and ranks differ: that is the point); the largest if several match."""
    fits = [
        m
        for m in meshes
        if m.device_type == saved["device_type"]
        and m.ndim == len(saved["shape"])
        and (list(m.mesh_dim_names) if m.mesh_dim_names else None) == saved.get("dims")
    ]
    return max(fits, key=lambda m: m.mesh.numel(), default=None)


def _set(tree: Any, leaf_path: str, value: Any) -> None:
    keys = leaf_path.strip("/").split("/")
    node = tree
    for k in keys[:-1]:
        node = _child(node, k)
    last = keys[-1]
    if isinstance(node, dict):
        node[_dict_key(node, last)] = value
    else:
        node[int(last)] = value


def _child(node: Any, k: str) -> Any:
    if isinstance(node, dict):
        return node[_dict_key(node, k)]
    return node[int(k)]


def _dict_key(node: dict[Any, Any], k: str) -> Any:
    if k in node:
        return k
    for key in node:  # a non-str key (an optimizer's parameter index), written as JSON in the path
        if not isinstance(key, str) and json.dumps(key) == k:
            return key
    raise CheckpointError(f"no key {k!r} in the saved state")
