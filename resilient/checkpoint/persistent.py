"""The ``Checkpointer``'s side of the persistent tier: uploads with remote retention, and restores.

Rank 0 uploads each committed step (:class:`Uploads`); any rank restores from the tier when no
local checkpoint verifies (:func:`restore_from_tier`). The tier itself, an fsspec URL, is
:class:`~resilient.checkpoint.tiers.PersistentTier` behind the :class:`Storage` Protocol.
"""

from __future__ import annotations

import contextlib
import functools
import shutil
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from loguru import logger

from resilient.checkpoint.backends import Storage, Uploader
from resilient.checkpoint.manifest import MANIFEST, Manifest, step_name
from resilient.checkpoint.reader import Loaded, load_step
from resilient.errors import CheckpointError


class Uploads:
    """Rank 0's uploads of committed steps, one after another on the uploader's thread.

    Incremental steps point into older step directories, and a queued upload reads them later:
    each pins the directories its files live in, so local retention keeps them until it is done.
    After each successful upload the tier is pruned by the same rule as the local directory.
    """

    def __init__(self, tier: Storage, uploader: Uploader, keep: int) -> None:
        self.tier = tier
        self._uploader = uploader
        self._keep = keep
        self._pinned: dict[int, set[str]] = {}  # step -> the local step directories its upload reads
        self._lock = threading.Lock()  # (uploads finish on the uploader's thread)

    def pinned(self) -> frozenset[str]:
        with self._lock:
            return frozenset().union(*self._pinned.values())

    def submit(self, root: Path, manifest: Manifest) -> None:
        """Queue the upload of committed ``manifest``; raises an earlier upload's failure instead."""
        step, files = manifest.step, [f.path for f in manifest.files()]
        with self._lock:
            self._pinned[step] = {p.split("/", 1)[0] for p in files}
        try:
            up = self._uploader.submit(root, step_name(step), files)
        except Exception:
            self._unpin(step)  # nothing queued: nothing will read them
            raise
        up.add_done_callback(functools.partial(self._uploaded, step))

    def _unpin(self, step: int) -> None:
        with self._lock:
            self._pinned.pop(step, None)

    def _uploaded(self, step: int, upload: Future[None]) -> None:
        self._unpin(step)
        if upload.exception() is None:
            self._prune()

    def _prune(self) -> None:
        """Keep the newest ``keep`` committed steps on the tier and every older one they point to."""
        try:
            names = self.tier.committed()
            needed: set[str] = set()
            for name in names[-self._keep :]:
                m = Manifest.model_validate_json(self.tier.read_bytes(f"{name}/{MANIFEST}"))
                needed |= {f.path.split("/", 1)[0] for f in m.files()} | {name}
            for name in names[: -self._keep]:
                if name not in needed:
                    self.tier.delete(name)
        except (CheckpointError, OSError, ValueError) as e:  # the next upload prunes again
            logger.warning(f"pruning {self.tier.url} failed: {e}")

    def close(self) -> None:
        """Wait for every queued upload; raise if any failed."""
        self._uploader.close()


def restore_from_tier(
    tier: Storage, root: Path, rank: int, world_size: int, sharded: dict[str, Any] | None
) -> Loaded | None:
    """The newest checkpoint of ``tier`` that loads on this rank, fetched into a cache beside
    ``root`` (newest first, falling back to older ones); None when none loads.

    The cache is its own checkpoint root (manifest written after the files), so a fetch cut short
    never looks like a committed local checkpoint.
    """
    cache = root / ".persistent-cache" / f"rank{rank:05d}"
    for name in reversed(tier.committed()):
        try:
            manifest = Manifest.model_validate_json(tier.read_bytes(f"{name}/{MANIFEST}"))
            need = {f.path for f in manifest.sharded_files()} if sharded is not None else set()
            if manifest.world_size == world_size:
                need |= {f.path for f in manifest.rank(rank).files}
            tier.fetch(sorted(need), cache)
            (cache / name).mkdir(parents=True, exist_ok=True)
            (cache / name / MANIFEST).write_bytes(manifest.model_dump_json().encode())
            loaded = load_step(cache, manifest.step, rank, world_size, sharded=sharded)
            logger.info(f"restored {name} from the persistent tier {tier.url}")
            return loaded
        except (CheckpointError, ValueError, OSError) as e:
            logger.warning(f"persistent checkpoint {name} does not load: {e}; trying the previous one")
        finally:
            shutil.rmtree(cache, ignore_errors=True)
            with contextlib.suppress(OSError):
                cache.parent.rmdir()  # only once every rank's cache is gone
    return None
