"""What a ``Checkpointer`` is built from: a writer, and optionally a persistent tier and its uploader.

Each is a small Protocol, so a test hands the ``Checkpointer`` fakes and a new variant is one class:

- :class:`ShardWriter` persists a staged save (this rank's shard; on rank 0 the commit and
  retention). ``"thread"``: :class:`~resilient.checkpoint.writer.ThreadWriter`; ``"process"``:
  :class:`~resilient.checkpoint.procwriter.ProcessWriter`; registered in :data:`WRITERS`.
- :class:`Storage` is the persistent tier (:class:`~resilient.checkpoint.tiers.PersistentTier`,
  any fsspec URL); :class:`Uploader` feeds it off the save path
  (:class:`~resilient.checkpoint.tiers.AsyncUploader`, rank 0 only).

:func:`build_backends` makes them from the validated :class:`~resilient.config.CheckpointConfig`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from resilient.checkpoint.manifest import Manifest
from resilient.checkpoint.procwriter import ProcessWriter
from resilient.checkpoint.staging import Arena
from resilient.checkpoint.writer import SaveJob, ThreadWriter, WriterSpec
from resilient.config import CheckpointConfig
from resilient.errors import CheckpointError


class ShardWriter(Protocol):
    """Persists one staged save at a time, called from the ``Checkpointer``'s background thread."""

    arena: Arena  # where the Checkpointer stages each save's tensors for this writer to read

    def write(self, job: SaveJob) -> Manifest | None:
        """Persist ``job``; rank 0 returns the committed manifest, other ranks None. Raises on failure."""
        ...

    def close(self) -> None:
        """Release the arena and whatever else the writer holds; a second call does nothing."""
        ...


class Storage(Protocol):
    """A persistent tier: committed steps by name (``step-00000100``), each with its manifest."""

    url: str

    def upload(self, local_root: Path, step_name: str, files: list[str]) -> None: ...

    def committed(self) -> list[str]:
        """The committed steps' names, oldest first."""
        ...

    def read_bytes(self, path: str) -> bytes: ...

    def fetch(self, paths: list[str], local_root: Path) -> None: ...

    def delete(self, step_name: str) -> None: ...


class Uploader(Protocol):
    """Uploads committed steps to a :class:`Storage` in the background, in submission order."""

    def submit(self, local_root: Path, step_name: str, files: list[str]) -> Future[None]:
        """Queue an upload; raises an earlier upload's failure (once) instead of queueing."""
        ...

    def close(self) -> None:
        """Wait for every queued upload; raise if any failed."""
        ...


@dataclass(frozen=True)
class Backends:
    """A ``Checkpointer``'s collaborators. ``uploader`` only where ``tier`` is set (rank 0)."""

    writer: ShardWriter
    tier: Storage | None = None
    uploader: Uploader | None = None


WRITERS: dict[str, Callable[[WriterSpec], ShardWriter]] = {"thread": ThreadWriter, "process": ProcessWriter}


def build_backends(cfg: CheckpointConfig, *, rank: int, world_size: int, token: str) -> Backends:
    """The writer ``cfg.writer`` names and, with ``cfg.persistent_url``, the tier and (rank 0) its
    uploader, for this rank's saves under ``cfg.dir``."""
    if cfg.dir is None:
        raise CheckpointError("checkpoint.dir is not set: there is nowhere to write checkpoints")
    spec = WriterSpec(Path(cfg.dir), rank, world_size, token, cfg.keep, cfg.incremental, cfg.commit_timeout_s)
    with contextlib.ExitStack() as undo:  # a part that fails to start takes the ones before it down
        tier = uploader = None
        if cfg.persistent_url:
            from resilient.checkpoint.tiers import AsyncUploader, PersistentTier  # fsspec: ~0.08 s

            tier = PersistentTier(cfg.persistent_url, **cfg.storage_options)
            if rank == 0:
                uploader = AsyncUploader(tier)
                undo.callback(uploader.close)
        writer = WRITERS[cfg.writer](spec)
        undo.pop_all()
    return Backends(writer, tier, uploader)
