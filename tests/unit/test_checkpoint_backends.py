"""The Checkpointer's collaborators: its writer, tier and uploader, injected as fakes or built by
``build_backends`` from the validated config."""

from __future__ import annotations

import threading
import typing
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

from resilient.checkpoint.backends import WRITERS, Backends, build_backends
from resilient.checkpoint.manager import Checkpointer, OnBusy
from resilient.checkpoint.manifest import MANIFEST, Manifest, RankEntry, step_name
from resilient.checkpoint.procwriter import ProcessWriter
from resilient.checkpoint.staging import Arena
from resilient.checkpoint.writer import SaveJob, ThreadWriter, WriterSpec
from resilient.config import CheckpointConfig
from resilient.errors import CheckpointError


class RecordingWriter:
    """A writer that keeps each job and the bytes staged for it, and commits nothing."""

    def __init__(self, fail: Exception | None = None) -> None:
        self.arena = Arena()
        self.jobs: list[SaveJob] = []
        self.staged: list[dict[str, bytes]] = []
        self.closed = 0
        self.fail = fail

    def write(self, job: SaveJob) -> Manifest | None:
        self.jobs.append(job)
        self.staged.append({s.key: bytes(self.arena.bytes_of(s)) for s in job.slots})
        if self.fail is not None:
            raise self.fail
        return Manifest(step=job.step, world_size=1, created=0.0, ranks=[RankEntry(rank=0, skeleton=None,
                        tensors=[], files=[])])  # fmt: skip

    def close(self) -> None:
        self.closed += 1


class MemoryTier:
    """Committed steps' manifests in a dict; what was deleted, in order."""

    url = "memory://tier"

    def __init__(self) -> None:
        self.manifests: dict[str, bytes] = {}
        self.deleted: list[str] = []

    def upload(self, local_root: Path, step_name: str, files: list[str]) -> None:
        self.manifests[step_name] = (local_root / step_name / MANIFEST).read_bytes()

    def committed(self) -> list[str]:
        return sorted(self.manifests)

    def read_bytes(self, path: str) -> bytes:
        return self.manifests[path.split("/", 1)[0]]

    def fetch(self, paths: list[str], local_root: Path) -> None:
        raise AssertionError("not fetched in these tests")

    def delete(self, step_name: str) -> None:
        self.deleted.append(step_name)
        del self.manifests[step_name]


class GatedUploader:
    """Queues uploads whose futures the test completes, uploading into ``tier`` when it does."""

    def __init__(self, tier: MemoryTier, refuse: Exception | None = None) -> None:
        self.tier = tier
        self.queued: list[tuple[Path, str, Future[None]]] = []
        self.refuse = refuse
        self.closed = 0

    def submit(self, local_root: Path, step_name: str, files: list[str]) -> Future[None]:
        if self.refuse is not None:
            raise self.refuse
        fut: Future[None] = Future()
        self.queued.append((local_root, step_name, fut))
        return fut

    def finish(self, i: int) -> None:
        root, name, fut = self.queued[i]
        self.tier.upload(root, name, [])
        fut.set_result(None)  # (its callbacks run here, on the test's thread)

    def close(self) -> None:
        self.closed += 1


def _thread_writer(root: Path, keep: int) -> ThreadWriter:
    return ThreadWriter(WriterSpec(root, rank=0, world_size=1, token="t", keep=keep, incremental=False))


def test_the_checkpointer_hands_each_staged_save_to_the_writer_it_is_given(tmp_path: Path) -> None:
    writer = RecordingWriter()
    ck = Checkpointer(tmp_path, token="t", backends=Backends(writer))
    x, y = torch.arange(4.0), torch.ones(2, dtype=torch.int64)
    fut = ck.save(7, {"m": {"x": x}, "n": [y, 3]}, extra={"why": "test"})
    assert fut is not None
    manifest = fut.result(timeout=30)
    assert manifest is not None and manifest.step == 7
    (job,) = writer.jobs
    assert (job.step, job.extra, job.dcp_files, job.pinned) == (7, {"why": "test"}, [], frozenset())
    assert job.skeleton == {"d": {"m": {"d": {"x": {"T": 0}}}, "n": {"l": [{"T": 1}, 3]}}}
    assert writer.staged == [{"/m/x": x.numpy().tobytes(), "/n/0": y.numpy().tobytes()}]
    ck.close()
    ck.close()
    assert writer.closed == 1


def test_a_writer_failure_is_a_checkpoint_error_naming_the_step(tmp_path: Path) -> None:
    writer = RecordingWriter(fail=OSError("disk full"))
    with Checkpointer(tmp_path, token="t", backends=Backends(writer)) as ck:
        ck.save(3, {"x": torch.ones(1)})
        with pytest.raises(CheckpointError, match=r"step-00000003 failed: OSError: disk full"):
            ck.wait()
    assert writer.closed == 1


def test_a_queued_upload_keeps_the_directories_it_reads_from_local_retention(tmp_path: Path) -> None:
    tier = MemoryTier()
    up = GatedUploader(tier)
    ck = Checkpointer(tmp_path, token="t", keep=1, incremental=False,
                      backends=Backends(_thread_writer(tmp_path, keep=1), tier, up))  # fmt: skip
    ck.save(1, {"x": torch.ones(4)})
    ck.wait()
    ck.save(2, {"x": torch.full((4,), 2.0)})
    ck.wait()
    assert [name for _, name, _ in up.queued] == [step_name(1), step_name(2)]
    assert (tmp_path / step_name(1)).is_dir()  # keep=1, but its upload has not run yet
    up.finish(0)
    ck.save(3, {"x": torch.full((4,), 3.0)})
    ck.wait()
    assert not (tmp_path / step_name(1)).exists()  # uploaded: retention takes it
    assert (tmp_path / step_name(2)).is_dir()  # still queued
    up.finish(1)
    assert tier.committed() == [step_name(2)] and tier.deleted == [step_name(1)]  # tier pruned to keep=1
    up.finish(2)
    ck.close()
    assert up.closed == 1 and tier.deleted == [step_name(1), step_name(2)]


def test_an_upload_refused_at_submit_pins_nothing(tmp_path: Path) -> None:
    tier = MemoryTier()
    up = GatedUploader(tier, refuse=CheckpointError("an earlier upload failed"))
    ck = Checkpointer(tmp_path, token="t", keep=1, incremental=False,
                      backends=Backends(_thread_writer(tmp_path, keep=1), tier, up))  # fmt: skip
    ck.save(1, {"x": torch.ones(4)})
    with pytest.raises(CheckpointError, match="an earlier upload failed"):
        ck.wait()
    up.refuse = None
    ck.save(2, {"x": torch.ones(4)})
    ck.wait()
    assert not (tmp_path / step_name(1)).exists()  # committed, never queued: not kept for an upload
    ck.close()


def test_build_backends_makes_what_the_config_names(tmp_path: Path) -> None:
    assert set(WRITERS) == set(typing.get_args(CheckpointConfig.model_fields["writer"].annotation))
    b = build_backends(CheckpointConfig(dir=tmp_path), rank=0, world_size=1, token="t")
    assert isinstance(b.writer, ThreadWriter) and b.tier is None and b.uploader is None
    b.writer.close()
    b = build_backends(CheckpointConfig(dir=tmp_path, writer="process"), rank=0, world_size=1, token="t")
    try:
        assert isinstance(b.writer, ProcessWriter) and b.writer.arena.path is not None
    finally:
        b.writer.close()
    url = f"file://{tmp_path / 'remote'}"
    rank0 = build_backends(
        CheckpointConfig(dir=tmp_path, persistent_url=url), rank=0, world_size=2, token="t"
    )
    rank1 = build_backends(
        CheckpointConfig(dir=tmp_path, persistent_url=url), rank=1, world_size=2, token="t"
    )
    assert rank0.tier is not None and rank0.tier.url == url and rank0.uploader is not None
    assert rank1.tier is not None and rank1.uploader is None  # only rank 0 uploads
    rank0.uploader.close()
    with pytest.raises(CheckpointError, match=r"checkpoint\.dir is not set"):
        build_backends(CheckpointConfig(), rank=0, world_size=1, token="t")


def test_a_writer_that_fails_to_start_stops_the_uploader_built_before_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(spec: WriterSpec) -> ThreadWriter:
        raise CheckpointError("no writer today")

    monkeypatch.setitem(WRITERS, "thread", broken)
    before = {t.name for t in threading.enumerate()}
    cfg = CheckpointConfig(dir=tmp_path, persistent_url=f"file://{tmp_path / 'remote'}")
    with pytest.raises(CheckpointError, match="no writer today"):
        build_backends(cfg, rank=0, world_size=1, token="t")
    assert "resilient-uploader" not in {t.name for t in threading.enumerate()} - before


def test_from_config_builds_the_checkpointer_the_config_describes(tmp_path: Path) -> None:
    cfg = CheckpointConfig(dir=tmp_path, keep=2, incremental=False, on_busy="skip", commit_timeout_s=5)
    with Checkpointer.from_config(cfg, rank=0, world_size=1, token="t") as ck:
        assert ck.config is cfg and (ck.root, ck.on_busy) == (tmp_path, OnBusy.SKIP)
        assert isinstance(ck.writer, ThreadWriter)
        assert ck.writer.spec == WriterSpec(tmp_path, 0, 1, "t", keep=2, incremental=False, commit_timeout=5)
        assert ck.tier is None


def test_the_config_is_the_one_source_of_the_settings(tmp_path: Path) -> None:
    cfg = CheckpointConfig(dir=tmp_path, keep=2)
    with pytest.raises(CheckpointError, match="not both"):
        Checkpointer(cfg, token="t", keep=3)
    with pytest.raises(CheckpointError, match=r"checkpoint\.dir is not set"):
        Checkpointer(CheckpointConfig(), token="t")
    with Checkpointer(tmp_path, token="t", keep=2, storage_options=None) as ck:  # None: the default
        assert ck.config == cfg


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"writer": "disk"}, r"Checkpointer\(writer='disk'\)"),
        ({"commit_timeout_s": 0}, r"Checkpointer\(commit_timeout_s=0\)"),
        ({"keep": 0}, r"Checkpointer\(keep=0\): .*greater than or equal to 1"),
        ({"commit_timeout": 5}, r"Checkpointer\(commit_timeout=5\): Extra inputs"),
        ({"writer": "process", "backends": Backends(RecordingWriter())}, r"backends= or writer="),
    ],
)
def test_invalid_arguments_are_refused_by_name(tmp_path: Path, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(CheckpointError, match=message):
        Checkpointer(tmp_path, token="t", **kwargs)
