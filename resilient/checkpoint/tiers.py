"""The persistent checkpoint tier behind any fsspec URL, and a background uploader that feeds it.

Object stores have no atomic rename, so a remote step is committed iff its manifest exists, and the
manifest is always written after every file it names. A crash mid-upload leaves an uncommitted step
that :meth:`PersistentTier.committed` never reports. Incremental checkpoints reference files in
earlier step directories; a file already present remotely with the same size is not copied again.
"""

from __future__ import annotations

import errno
import os
import queue
import random
import re
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar

import fsspec
import tenacity
from fsspec.implementations.local import LocalFileSystem
from loguru import logger

from resilient.errors import CheckpointError

T = TypeVar("T")
MANIFEST = "manifest.json"
_STEP = re.compile(r"step-(\d+)")
# What another attempt can fix: OSError (ConnectionError, TimeoutError, fsspec's I/O errors) and botocore's
# errors, but not the OSErrors that say the request itself is wrong (s3fs maps S3's codes onto these).
_PERMANENT = (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError, PermissionError)
_PERMANENT_ERRNO = {errno.EINVAL, errno.EPERM, errno.EACCES, errno.ENOSYS, errno.ENAMETOOLONG, errno.EROFS}
try:
    from botocore.exceptions import BotoCoreError, ClientError

    _TRANSIENT: tuple[type[Exception], ...] = (OSError, BotoCoreError, ClientError)
except ImportError:  # no S3 support installed, so nothing botocore-specific can be raised
    _TRANSIENT = (OSError,)


def _is_transient(exc: BaseException) -> bool:
    if isinstance(exc, _PERMANENT) or (isinstance(exc, OSError) and exc.errno in _PERMANENT_ERRNO):
        return False
    return isinstance(exc, _TRANSIENT)


def _relative(path: str) -> str:
    """Normalise a root-relative path; refuse one that could escape the root on either side."""
    p = PurePosixPath(path)
    if not path or p.is_absolute() or ".." in p.parts or "\\" in path or str(p) == ".":
        raise CheckpointError(f"checkpoint path {path!r} must be relative to the root, without '..'")
    return str(p)


def _step_name(name: str) -> str:
    if not _STEP.fullmatch(name):
        raise CheckpointError(f"step name {name!r} must look like 'step-00000100'")
    return name


class PersistentTier:
    """Checkpoint storage behind an fsspec URL (``file://``, ``s3://``, ``gs://`` ...).

    Retries are bounded by attempts and by total time; the jitter comes from a private RNG because the
    global ``random`` state belongs to the user's (tracked, restored) training state.
    """

    def __init__(
        self,
        url: str,
        *,
        retry_attempts: int = 5,
        retry_deadline_s: float = 120.0,
        retry_sleep: Callable[[float], None] = time.sleep,
        rng: random.Random | None = None,
        **storage_options: Any,
    ) -> None:
        self.url = url
        self.fs, root = fsspec.core.url_to_fs(url, **storage_options)
        self.root: str = root.rstrip("/")
        self._rng = rng or random.Random()
        base = tenacity.wait_exponential(multiplier=0.5, max=10.0)
        self._retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(retry_attempts) | tenacity.stop_after_delay(retry_deadline_s),
            wait=lambda state: base(state) + self._rng.uniform(0.0, 0.5),
            retry=tenacity.retry_if_exception(_is_transient),
            sleep=retry_sleep,
            reraise=True,
            before_sleep=lambda s: logger.warning(
                "checkpoint store {}: attempt {} failed ({!r}); retrying",
                url,
                s.attempt_number,
                s.outcome.exception() if s.outcome else None,
            ),
        )

    def _path(self, rel: str) -> str:
        return f"{self.root}/{_relative(rel)}"

    def _call(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        try:
            return self._retrying(fn, *args)
        except Exception as e:
            raise CheckpointError(f"{what} at {self.url} failed: {e!r}") from e

    def _size(self, rel: str) -> int | None:
        try:
            info = self.fs.info(self._path(rel))
        except FileNotFoundError:
            return None
        return int(info["size"]) if info.get("type") == "file" else None

    def _put(self, src: Path, rel: str) -> None:
        dst = self._path(rel)
        # Only the local filesystem's put_file needs its parents made: object stores have no directories
        # (s3fs's makedirs would even create a missing bucket), and fsspec's generic put_file makes them.
        if isinstance(self.fs, LocalFileSystem):
            self.fs.makedirs(self.fs._parent(dst), exist_ok=True)
        self.fs.put_file(str(src), dst)  # streams large files in chunks (s3fs: multipart above 100 MiB)

    def _local_size(self, src: Path) -> int:
        try:
            return src.stat().st_size
        except OSError as e:
            raise CheckpointError(f"cannot upload {src} to {self.url}: {e}") from e

    def upload(
        self, local_root: Path, step_name: str, files: list[str], manifest_name: str = MANIFEST
    ) -> None:
        """Copy ``files`` (relative to ``local_root``) to the store, then commit the step with its manifest.

        A file of an earlier step that the store holds at the same size is not copied again. This step's
        own files always are: shard sizes follow from tensor shapes, so an equal size left by a dead
        upload of another incarnation of this step (a rollback replayed it) proves nothing.
        """
        local_root = Path(local_root)
        manifest_rel = _relative(f"{_step_name(step_name)}/{manifest_name}")
        local_manifest = local_root / manifest_rel
        self._local_size(local_manifest)  # fail before copying anything if there is nothing to commit
        self.fs.invalidate_cache()  # another process may have written since we last listed
        if self._call(f"stat {manifest_rel}", self._size, manifest_rel) is not None:
            if self.read_bytes(manifest_rel) == local_manifest.read_bytes():
                logger.debug("{} is already committed at {}", step_name, self.url)
                return
            # committed by another incarnation of this step: uncommit it before rewriting its files
            self._call(f"uncommit {manifest_rel}", self.fs.rm_file, self._path(manifest_rel))
        copied = 0
        for rel in map(_relative, files):
            if rel == manifest_rel:
                continue  # written last, below
            src = local_root / rel
            size = self._local_size(src)
            if not rel.startswith(step_name + "/") and self._call(f"stat {rel}", self._size, rel) == size:
                continue
            self._call(f"upload of {rel}", self._put, src, rel)
            copied += 1
        self._call(f"upload of {manifest_rel}", self._put, local_manifest, manifest_rel)
        logger.info("committed {} at {} ({} of {} files copied)", step_name, self.url, copied, len(files))

    def _list_root(self) -> list[str]:
        try:
            return list(self.fs.ls(self.root or "/", detail=False))
        except FileNotFoundError:
            return []  # nothing was ever uploaded here

    def committed(self, manifest_name: str = MANIFEST) -> list[str]:
        """Names of the committed steps (their manifest exists), oldest first."""
        self.fs.invalidate_cache()
        entries = self._call("listing", self._list_root)
        names = [n for n in (str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries) if _STEP.fullmatch(n)]
        done = [n for n in names if self._call("stat", self.fs.isfile, self._path(f"{n}/{manifest_name}"))]
        return sorted(done, key=lambda n: int(n[5:]))

    def read_bytes(self, path: str) -> bytes:
        return bytes(self._call(f"read of {path}", self.fs.cat_file, self._path(path)))

    def _get(self, rel: str, dst: Path) -> None:
        remote = self._path(rel)
        size = int(self.fs.info(remote)["size"])
        tmp = dst.with_name(f".{dst.name}.{uuid.uuid4().hex[:8]}.part")
        try:
            self.fs.get_file(remote, str(tmp))
            got = tmp.stat().st_size
            if got != size:  # a dropped connection can look like a short, successful read
                raise OSError(f"downloaded {got} of {size} bytes of {rel}")
            os.replace(tmp, dst)
        finally:
            tmp.unlink(missing_ok=True)

    def fetch(self, paths: list[str], local_root: Path) -> None:
        """Download ``paths`` into ``local_root``; each file appears under its name only once complete."""
        for rel in map(_relative, paths):
            dst = Path(local_root) / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            self._call(f"download of {rel}", self._get, rel, dst)

    def delete(self, step_name: str, manifest_name: str = MANIFEST) -> None:
        """Remove a step: the manifest first, so a half-deleted step is never seen as committed.

        Later incremental steps may reference this step's files; keeping those alive is the caller's job.
        """
        step = _step_name(step_name)
        manifest = self._path(f"{step}/{manifest_name}")
        self.fs.invalidate_cache()
        if self._call(f"stat {manifest}", self.fs.exists, manifest):
            self._call(f"delete of {manifest}", self.fs.rm_file, manifest)
        if self._call(f"stat {step}", self.fs.exists, self._path(step)):
            self._call(f"delete of {step}", self.fs.rm, self._path(step), True)
        self.fs.invalidate_cache()


@dataclass
class _Job:
    local_root: Path
    step_name: str
    files: list[str]
    future: Future[None] = field(default_factory=Future)


class AsyncUploader:
    """Uploads steps on one daemon thread, one at a time, in submission order.

    A failure completes its future with the error, is raised (once) by the next :meth:`submit`, and
    is raised again by :meth:`close`, which says whether everything submitted reached the store.
    """

    def __init__(self, tier: PersistentTier) -> None:
        self.tier = tier
        # Unbounded on purpose: a slow store must never block the training step that submits; the
        # futures (and close) say how far behind the uploads are.
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._unreported: list[tuple[str, Exception]] = []
        self._failed: list[tuple[str, Exception]] = []
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="resilient-uploader", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            if not job.future.set_running_or_notify_cancel():
                continue
            try:
                self.tier.upload(job.local_root, job.step_name, job.files)
            except Exception as e:
                logger.error("upload of {} to {} failed: {}", job.step_name, self.tier.url, e)
                with self._lock:
                    self._unreported.append((job.step_name, e))
                    self._failed.append((job.step_name, e))
                job.future.set_exception(e)
            else:
                job.future.set_result(None)

    @staticmethod
    def _describe(failures: list[tuple[str, Exception]]) -> str:
        return "upload failed for " + ", ".join(f"{step} ({e})" for step, e in failures)

    def submit(self, local_root: Path, step_name: str, files: list[str]) -> Future[None]:
        """Queue an upload; raise first if an earlier one failed unreported (then nothing is queued)."""
        job = _Job(Path(local_root), step_name, list(files))
        with self._lock:
            if self._closed:
                raise CheckpointError(f"uploader to {self.tier.url} is closed")
            failures, self._unreported = self._unreported, []
            if not failures:
                self._queue.put(job)
        if failures:
            raise CheckpointError(f"an earlier {self._describe(failures)}") from failures[0][1]
        return job.future

    def close(self, timeout: float = 600.0) -> None:
        """Wait for every queued upload, stop the thread, and raise if any upload failed. Idempotent."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._queue.put(None)  # after every job already queued
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise CheckpointError(f"uploads to {self.tier.url} still running after {timeout:g}s")
        with self._lock:
            failures, self._failed, self._unreported = self._failed, [], []
        if failures:
            raise CheckpointError(f"closing the uploader: {self._describe(failures)}") from failures[0][1]

    def __enter__(self) -> AsyncUploader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
