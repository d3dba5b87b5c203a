"""Loading the newest committed checkpoint that verifies, falling back to older ones.

Each tensor is read straight into its own memory and its xxh3-128 checked against the manifest;
every file's size is checked first (a truncated file fails before any read). Nothing is unpickled.
A newest checkpoint that is corrupt or truncated produces a warning naming the file, then the
previous one is tried; when none verifies the error lists every checkpoint tried and why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import xxhash
from loguru import logger

from resilient.checkpoint.codec import decode, dtype_from_name
from resilient.checkpoint.integrity import verify_file
from resilient.checkpoint.manifest import (
    MANIFEST,
    Manifest,
    TensorEntry,
    committed_steps,
    read_manifest,
    step_name,
)
from resilient.checkpoint.reshard import reshard_rank
from resilient.errors import CheckpointError, NoValidCheckpoint


@dataclass
class Loaded:
    step: int
    state: Any
    manifest: Manifest
    path: Path
    rejected: list[str] = field(default_factory=list)  # newer checkpoints that did not verify, why
    rejected_steps: list[int] = field(default_factory=list)  # ... and their steps
    resharded_from: int | None = None  # written at this other world size, resharded on load
    per_rank_from: dict[str, int] = field(default_factory=dict)  # per-rank objects: name -> old rank


def _read_into(path: Path, offset: int, out: memoryview) -> None:
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        got = 0
        while got < len(out):
            n = f.readinto(out[got:])
            if not n:
                raise CheckpointError(f"{path}: short read at byte {offset + got}")
            got += n


def read_tensor(root: Path, entry: TensorEntry) -> torch.Tensor:
    """One tensor read straight into its own memory, its xxh3-128 checked against the manifest.

    Every tensor owns its storage (no views into a shared file buffer): ``Generator.set_state``,
    ``torch.set_rng_state`` and optimizers keep or reinterpret what they are given.
    """
    t = torch.empty(entry.shape, dtype=dtype_from_name(entry.dtype))
    if t.numel() * t.element_size() != entry.nbytes:
        raise CheckpointError(f"{root / entry.file}: tensor {entry.key} size does not match its shape")
    if entry.nbytes:
        raw = t.reshape(-1).view(torch.uint8).numpy().data
        _read_into(root / entry.file, entry.offset, raw)
        if xxhash.xxh3_128_hexdigest(raw) != entry.xxh3:
            raise CheckpointError(f"{root / entry.file}: checksum mismatch in tensor {entry.key} (corrupt)")
    return t


def load_step(
    root: Path,
    step: int,
    rank: int,
    world_size: int | None = None,
    *,
    sharded: dict[str, Any] | None = None,
    collective: bool = True,
    meshes: list[Any] | None = None,
) -> Loaded:
    """This rank's state in checkpoint ``step``; raises CheckpointError naming what failed.

    With ``sharded`` (a DTensor/FSDP2 state dict to load into, in place), every rank's DCP files are
    verified and, if ``collective``, loaded through DCP, resharding to the current world size. At a
    different world size the per-rank state cannot be restored: ``Loaded.state`` is then None.

    With ``meshes`` (the device meshes today's objects live on), a checkpoint of another world size
    is resharded instead (:mod:`resilient.checkpoint.reshard`): DTensor leaves onto those meshes,
    replicated objects as they are, per-rank objects from old rank ``rank % old_world``.
    """
    path = root / step_name(step)
    manifest = read_manifest(path / MANIFEST)
    if manifest.step != step:
        raise CheckpointError(f"{path / MANIFEST}: says step {manifest.step}, directory says {step}")
    resharding = world_size is not None and manifest.world_size != world_size
    if resharding and sharded is None and meshes is not None:
        moved, per_rank = reshard_rank(root, path, manifest, rank, meshes, read_tensor)
        return Loaded(step, moved, manifest, path, resharded_from=manifest.world_size, per_rank_from=per_rank)
    if resharding and sharded is None:
        raise CheckpointError(
            f"{path}: written by {manifest.world_size} ranks, this job has {world_size}; per-rank state "
            "cannot be split or merged (DTensor/FSDP2 state reshards: pass sharded=)"
        )
    if sharded is not None:
        dcp_files = manifest.sharded_files()
        if not dcp_files:
            raise CheckpointError(f"{path}: holds no sharded (DCP) state")
        for f in dcp_files:
            verify_file(root, f)
    state: Any = None
    if resharding:
        logger.warning(
            f"{path}: written by {manifest.world_size} ranks, loading on {world_size}: sharded state "
            "reshards; per-rank state (RNG, data position) is not restored"
        )
    else:
        state = _load_rank(root, path, manifest, rank)
    loaded = Loaded(step, state, manifest, path)
    if sharded is not None and collective:
        from resilient.checkpoint.sharded import load_sharded  # DCP: ~0.5 s to import, only if used

        load_sharded(sharded, path / "dcp")
    return loaded


def _load_rank(root: Path, path: Path, manifest: Manifest, rank: int) -> Any:
    entry = manifest.rank(rank)
    files = {f.path: f for f in entry.files}
    for f in files.values():
        try:
            size = (root / f.path).stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"{root / f.path}: file missing") from None
        if size != f.size:
            raise CheckpointError(f"{root / f.path}: {size} bytes, the manifest says {f.size} (truncated?)")
    tensors = []
    for t in entry.tensors:
        if t.file not in files:
            raise CheckpointError(f"{path / MANIFEST}: tensor {t.key} lives in unlisted file {t.file}")
        if t.offset + t.nbytes > files[t.file].size:
            raise CheckpointError(f"{root / t.file}: tensor {t.key} runs past the end of the file")
        tensors.append(read_tensor(root, t))
    try:
        return decode(entry.skeleton, tensors)
    except CheckpointError as e:
        raise CheckpointError(f"{path / MANIFEST}: field ranks[{rank}].skeleton: {e}") from None


def load_latest(
    root: Path,
    rank: int = 0,
    world_size: int | None = None,
    *,
    agree: Callable[[bool], bool] | None = None,
    sharded: dict[str, Any] | None = None,
    meshes: list[Any] | None = None,
) -> Loaded | None:
    """The newest checkpoint that verifies (on every rank, when ``agree`` votes across ranks).

    ``agree(ok)`` must return True only if every rank's ``ok`` is True (an all-reduce MIN); all
    ranks walk the same list of steps, so they vote on the same candidate each round. Sharded state
    is loaded (collectively) only once every rank verified the candidate. Returns None when there is
    no checkpoint at all.
    """
    tried: list[str] = []
    bad: list[int] = []
    for step in committed_steps(root):
        loaded: Loaded | None = None
        try:
            loaded = load_step(root, step, rank, world_size, sharded=sharded, collective=False, meshes=meshes)
        except CheckpointError as e:
            if "cannot be split or merged" in str(e):
                raise
            logger.warning(f"checkpoint {step_name(step)} does not verify: {e}; trying the previous one")
            tried.append(f"{step_name(step)}: {e}")
        ok = loaded is not None
        if not ok:
            bad.append(step)
        if agree is not None and not agree(ok):
            if ok:
                bad.append(step)
                tried.append(f"{step_name(step)}: another rank could not verify its part")
                logger.warning(f"checkpoint {step_name(step)} does not verify on another rank; falling back")
            continue
        if loaded is not None:
            if sharded is not None:
                from resilient.checkpoint.sharded import load_sharded  # DCP: ~0.5 s to import, only if used

                load_sharded(sharded, loaded.path / "dcp")
            loaded.rejected = list(tried)
            loaded.rejected_steps = list(bad)
            return loaded
    if tried:
        raise NoValidCheckpoint(
            f"no valid checkpoint in {root}; tried:\n  " + "\n  ".join(tried) + "\nA relaunch would read the "
            "same bytes: restore a good copy (another tier, a backup), or move these aside to start over",
            tried,
            bad,
        )
    return None
