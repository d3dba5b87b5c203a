"""The latest snapshot of a rank in shared memory, so that a relaunched worker restores from RAM.

Files in ``/dev/shm`` outlive the process that wrote them (unlike ``multiprocessing.shared_memory``,
whose resource tracker unlinks segments when the creator dies). Two slots alternate, each with its
own ``slotK.json`` (JSON skeleton, layout, xxh3-128 of the bytes or, for the runtime's mirror, the
byte sums of its tensors the replica digests already took), removed before the slot is
overwritten and written back after: a worker killed mid-copy leaves the other snapshot whole, and
both complete snapshots are offered, so ranks one snapshot apart can still agree on a step. The
launcher keeps the directory across restarts of the worker and removes it when the job ends.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import xxhash
from loguru import logger

from resilient.checkpoint.codec import check_layout, decode, dtype_from_name, encode
from resilient.checkpoint.manifest import write_json_durable
from resilient.checkpoint.staging import Arena, extent
from resilient.errors import CheckpointError
from resilient.state.digest import Leaf, tensor_sums
from resilient.state.dtensor import holds_dtensors

SHM = Path("/dev/shm")


class ShmSnapshot:
    """Capture/load the newest state of one rank under ``/dev/shm/resilient-<name>/rank<R>``."""

    def __init__(self, name: str, rank: int = 0, base: Path = SHM) -> None:
        """``rank`` names this process's directory: under ``resilient launch`` the *local* rank, so
        a relaunched worker finds its predecessor's snapshot even when the rendezvous gave its node
        a different group rank; the global rank and world size of each snapshot are in its meta."""
        if not name or "/" in name or name.startswith("."):
            raise CheckpointError(f"shared-memory snapshot name {name!r} must be a plain file name")
        self.top = base / f"resilient-{name}"
        self.dir = self.top / f"rank{rank:05d}"
        self._arenas: list[Arena] = []

    @classmethod
    def at(cls, directory: Path) -> ShmSnapshot:
        """The snapshot slots in ``directory`` itself, wherever it is (a flushed copy on disk:
        :mod:`resilient.checkpoint.flushed`); ``unlink`` removes that directory only."""
        snap = cls.__new__(cls)
        snap.top = snap.dir = directory
        snap._arenas = []
        return snap

    def _meta(self, slot: int) -> dict[str, Any] | None:
        """A slot's description, checked field by field before any of it is trusted."""
        path = self.dir / f"slot{slot}.json"
        try:
            meta = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (ValueError, RecursionError) as e:
            raise CheckpointError(f"{path}: does not parse: {e}") from None
        if not isinstance(meta, dict):
            raise CheckpointError(f"{path}: a {type(meta).__name__}, not a slot description")
        for name, ok in (
            ("step", type(meta.get("step")) is int and meta["step"] >= 0),
            ("size", type(meta.get("size")) is int and meta["size"] >= 0),
            ("rank", meta.get("rank") is None or (type(meta["rank"]) is int and meta["rank"] >= 0)),
            ("world", meta.get("world") is None or (type(meta["world"]) is int and meta["world"] >= 1)),
            ("xxh3", meta.get("xxh3") is None or isinstance(meta["xxh3"], str)),
            (
                "sums",
                meta.get("sums") is None
                or (isinstance(meta["sums"], dict) and all(type(v) is int for v in meta["sums"].values())),
            ),
            ("skeleton", "skeleton" in meta),
        ):
            if not ok:
                raise CheckpointError(f"{path}: field {name}: {str(meta.get(name))[:80]!r} is not valid")
        check_layout(meta.get("layout"), meta["size"], str(path), keyed=True)
        return meta

    def _usable(self, slot: int) -> dict[str, Any] | None:
        try:
            return self._meta(slot)
        except CheckpointError:
            return None

    def steps(self) -> list[int]:
        """Steps of the complete snapshots held (newest first): up to two."""
        return [int(m["step"]) for m in self.slots()]

    def slots(self) -> list[dict[str, Any]]:
        """The complete snapshots held, newest first: ``{"step", "rank", "world", "sharded"}`` (the
        global rank and world size that wrote it, None for both when the writer did not say; whether
        it holds DTensor shards, which only a mesh of the same size can take back from memory)."""
        held = []
        for slot in (0, 1):
            try:
                meta = self._meta(slot)
            except CheckpointError:
                continue
            if meta is not None:
                held.append(
                    {
                        "step": int(meta["step"]),
                        "rank": meta.get("rank"),
                        "world": meta.get("world"),
                        "sharded": bool(meta.get("sharded", False)),
                    }
                )
        return sorted(held, key=lambda m: -int(m["step"]))

    def drop_after(self, step: int) -> list[int]:
        """Forget the snapshots of steps after ``step`` (a roll-back to it replays them, and the
        replay, not the state before the roll-back, is what stands): their descriptions go, so
        nothing restores them and the next capture writes afresh. Returns the steps dropped."""
        dropped = []
        for slot in (0, 1):
            meta = self._usable(slot)
            if meta is not None and int(meta["step"]) > step:
                (self.dir / f"slot{slot}.json").unlink(missing_ok=True)
                dropped.append(int(meta["step"]))
        return dropped

    def holds(self, step: int, rank: int, world: int) -> bool:
        return any((m["step"], m["rank"], m["world"]) == (step, rank, world) for m in self.slots())

    def capture(
        self,
        step: int,
        state: dict[str, Any],
        *,
        checksum: bool = True,
        owner: tuple[int, int] | None = None,
        sums: Mapping[str, Leaf] | None = None,
    ) -> None:
        """Copy ``state`` into the older slot. Its ``slotK.json`` goes first and comes back last, so
        a worker killed mid-copy leaves the other slot, and only it, described and whole.
        ``sums``: the byte sums of ``state``'s tensor leaves by path, already taken (the replica
        digests'): kept with the slot and verified when it is loaded, at no cost to the capture."""
        self.dir.mkdir(parents=True, exist_ok=True)
        if not self._arenas:
            self._arenas = [Arena(self.dir / f"slot{i}.bin") for i in (0, 1)]
        metas = [self._usable(i) for i in (0, 1)]  # (a malformed slot is the one overwritten)
        spare = min((0, 1), key=lambda i: -1 if metas[i] is None else int(metas[i]["step"]))  # type: ignore[index]
        (self.dir / f"slot{spare}.json").unlink(missing_ok=True)
        skeleton, leaves = encode(state)
        arena = self._arenas[spare]
        slots = arena.stage(leaves)
        size = extent(slots)
        digest = xxhash.xxh3_128_hexdigest(arena.buf[:size].numpy().data) if checksum else None
        meta = {
            "step": step,
            "rank": owner[0] if owner else None,  # the global rank and world that wrote it
            "world": owner[1] if owner else None,
            "size": size,
            "xxh3": digest,
            "sums": {k: int(v[0]) for k, v in sums.items()} if sums is not None else None,
            "sharded": holds_dtensors(state),  # (only a mesh of the same size takes them back)
            "skeleton": skeleton,
            "layout": [[s.key, s.dtype, list(s.shape), s.offset, s.nbytes] for s in slots],
        }
        write_json_durable(self.dir / f"slot{spare}.json", meta, durable=False)  # RAM: nothing to sync

    def load(self, step: int | None = None, *, mapped: bool = False) -> tuple[int, Any] | None:
        """(step, state) of the newest snapshot (or of ``step``), or None; tensors are copies, or
        with ``mapped`` views of a private mapping of the slot (no copy: the caller copies what it
        keeps, once, e.g. a module's ``load_state_dict``; the slot must not be rewritten meanwhile)."""
        held = {}
        for i in (0, 1):
            try:
                m = self._meta(i)
            except CheckpointError as e:  # (the other slot may still be whole)
                logger.warning(f"snapshot slot not usable: {e}")
                continue
            if m is not None:
                held[int(m["step"])] = (i, m)
        if not held:
            return None
        want = max(held) if step is None else step
        if want not in held:
            raise CheckpointError(f"{self.dir}: no snapshot of step {want} (held: {sorted(held)})")
        slot, meta = held[want]
        path = self.dir / f"slot{slot}.bin"
        size = int(meta["size"])
        try:
            f = open(path, "rb")  # noqa: SIM115 - closed below, after the mapping
        except FileNotFoundError:
            raise CheckpointError(f"{path}: snapshot slot missing") from None
        with f:
            if os.fstat(f.fileno()).st_size < size:
                raise CheckpointError(f"{path}: shorter than the {size} bytes its snapshot needs")
            if mapped and size:  # copy-on-write: nothing done to the views reaches the file
                cow = mmap.mmap(
                    f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
                )
                return want, self._views(cow, meta)
            mm = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) if size else None
        try:
            view = memoryview(mm) if mm is not None else memoryview(b"")
            if meta["xxh3"] is not None and xxhash.xxh3_128_hexdigest(view) != meta["xxh3"]:
                raise CheckpointError(f"{path}: checksum mismatch (corrupt snapshot)")
            # one copy, straight from the mapped pages into tensors that own their memory
            tensors = []
            for _key, dtype, shape, offset, nbytes in meta["layout"]:
                t = torch.empty(tuple(shape), dtype=dtype_from_name(dtype))
                if nbytes:
                    t.reshape(-1).view(torch.uint8).numpy()[:] = view[offset : offset + nbytes]
                tensors.append(t)
            view.release()
        finally:
            if mm is not None:
                mm.close()
        verify_sums(meta, tensors, path)
        return want, decode(meta["skeleton"], tensors)

    @staticmethod
    def _views(mm: mmap.mmap, meta: dict[str, Any]) -> Any:
        if meta["xxh3"] is not None and xxhash.xxh3_128_hexdigest(mm) != meta["xxh3"]:
            raise CheckpointError("checksum mismatch (corrupt snapshot)")
        tensors = []
        for _key, dtype, shape, offset, nbytes in meta["layout"]:
            dt = dtype_from_name(dtype)
            if nbytes:  # (the tensor keeps the mapping alive; offsets are 64-byte aligned)
                raw = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=offset)
                tensors.append(raw.view(dt).reshape(tuple(shape)))
            else:
                tensors.append(torch.empty(tuple(shape), dtype=dt))
        verify_sums(meta, tensors, "snapshot slot")
        return decode(meta["skeleton"], tensors)

    def close(self) -> None:
        """Unmap this process's slots; the snapshot stays in shared memory."""
        for a in self._arenas:
            a.release()
        self._arenas = []

    def unlink(self) -> None:
        """Remove every rank's snapshot of this job from shared memory."""
        self.close()
        shutil.rmtree(self.top, ignore_errors=True)


def verify_sums(meta: Mapping[str, Any], tensors: list[torch.Tensor], where: object) -> None:
    """The slot's tensors against the byte sums taken when they were captured, if any were."""
    sums = meta.get("sums")
    if not sums:
        return
    keyed = [(key, t) for (key, *_), t in zip(meta["layout"], tensors, strict=True) if key in sums]
    for (key, _), total in zip(keyed, tensor_sums([t for _, t in keyed]), strict=True):
        if total != sums[key]:
            raise CheckpointError(
                f"{where}: leaf {key!r} of the snapshot of step {meta['step']} has byte sum {total:#x}, "
                f"{sums[key]:#x} when captured (corrupt snapshot)"
            )
