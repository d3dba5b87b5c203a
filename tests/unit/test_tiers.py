"""PersistentTier and AsyncUploader against a real file:// tree and a real S3 server (moto, over HTTP)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from resilient.checkpoint.tiers import AsyncUploader, PersistentTier
from resilient.errors import CheckpointError


def write_step(root: Path, step: str, files: dict[str, bytes], refs: tuple[str, ...] = ()) -> list[str]:
    """Write a committed local step (files, then the manifest); return every path its manifest names."""
    for name, data in files.items():
        (root / step / name).parent.mkdir(parents=True, exist_ok=True)
        (root / step / name).write_bytes(data)
    rels = [f"{step}/{n}" for n in files] + list(refs)
    (root / step / "manifest.json").write_text(json.dumps({"files": rels}))
    return [*rels, f"{step}/manifest.json"]


def assert_same(a: Path, b: Path, rels: list[str]) -> None:
    for rel in rels:
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel


def no_sleep(_: float) -> None:
    pass


@pytest.fixture
def local(tmp_path: Path) -> Path:
    return tmp_path / "local"


@pytest.fixture
def remote(tmp_path: Path) -> Path:
    return tmp_path / "remote"


@pytest.fixture
def tier(remote: Path) -> PersistentTier:
    return PersistentTier(f"file://{remote}", retry_sleep=no_sleep)


def test_file_round_trip_with_incremental_reference(tier: PersistentTier, local: Path, tmp_path: Path):
    s90 = write_step(local, "step-00000090", {"rank00000.bin": b"a" * 100, "rank00001.bin": b"b" * 50})
    s100 = write_step(
        local,
        "step-00000100",
        {"rank00000.bin": os.urandom(300), "dcp/nested/shard.distcp": os.urandom(70)},
        refs=("step-00000090/rank00001.bin",),
    )
    assert tier.committed() == []  # the remote root does not even exist yet
    tier.upload(local, "step-00000090", s90)
    tier.upload(local, "step-00000100", s100)
    assert tier.committed() == ["step-00000090", "step-00000100"]
    assert (
        json.loads(tier.read_bytes("step-00000100/manifest.json"))["files"][-1]
        == "step-00000090/rank00001.bin"
    )

    fresh = tmp_path / "fresh"
    tier.fetch(s100, fresh)
    assert_same(local, fresh, s100)
    assert not list(fresh.rglob("*.part"))

    tier.delete("step-00000090")
    assert tier.committed() == ["step-00000100"]
    assert not (Path(tier.root) / "step-00000090").exists()
    tier.delete("step-00000090")  # deleting what is gone is a no-op


def test_committed_ignores_other_names_and_sorts_by_number(tier: PersistentTier, remote: Path):
    for name in ["step-00000010", "step-9", "step-00000100", "step-00000050.tmp", "latest", "step-x"]:
        (remote / name).mkdir(parents=True)
        (remote / name / "manifest.json").write_text("{}")
    (remote / "step-00000200").mkdir()  # no manifest: an upload that died
    assert tier.committed() == ["step-9", "step-00000010", "step-00000100"]


def test_upload_that_dies_before_the_manifest_is_not_committed(
    tier: PersistentTier, local: Path, remote: Path
):
    rels = write_step(local, "step-00000001", {"rank00000.bin": b"x" * 10})
    (remote / "step-00000001" / "manifest.json").mkdir(parents=True)  # a real failure: copy onto a dir
    with pytest.raises(CheckpointError, match=r"manifest\.json") as err:
        tier.upload(local, "step-00000001", rels)
    assert str(remote) in str(err.value)
    assert (remote / "step-00000001" / "rank00000.bin").read_bytes() == b"x" * 10  # the files went up
    assert tier.committed() == []

    # Another incarnation of the step (same shapes, so same sizes) must not inherit the dead upload's bytes.
    (remote / "step-00000001" / "manifest.json").rmdir()
    (local / "step-00000001" / "rank00000.bin").write_bytes(b"y" * 10)
    tier.upload(local, "step-00000001", rels)
    assert (remote / "step-00000001" / "rank00000.bin").read_bytes() == b"y" * 10
    assert tier.committed() == ["step-00000001"]


def test_file_with_the_same_size_remotely_is_not_uploaded_again(
    tier: PersistentTier, local: Path, monkeypatch: pytest.MonkeyPatch
):
    s1 = write_step(local, "step-00000001", {"rank00000.bin": b"a" * 64, "rank00001.bin": b"b" * 64})
    tier.upload(local, "step-00000001", s1)
    put = tier.fs.put_file
    copied: list[str] = []

    def counting(src: str, dst: str, **kw: Any) -> None:
        copied.append(dst.rsplit("/", 2)[-2] + "/" + dst.rsplit("/", 1)[-1])
        put(src, dst, **kw)

    monkeypatch.setattr(tier.fs, "put_file", counting)
    s2 = write_step(
        local, "step-00000002", {"rank00000.bin": b"c" * 64}, refs=("step-00000001/rank00001.bin",)
    )
    tier.upload(local, "step-00000002", s2)
    assert copied == ["step-00000002/rank00000.bin", "step-00000002/manifest.json"]
    copied.clear()
    tier.upload(local, "step-00000002", s2)  # already committed with this very manifest
    assert copied == []


def test_replayed_step_is_rewritten_even_when_sizes_match(tier: PersistentTier, local: Path, remote: Path):
    rels = write_step(local, "step-00000005", {"rank00000.bin": b"old!"})
    tier.upload(local, "step-00000005", rels)
    (local / "step-00000005" / "rank00000.bin").write_bytes(b"new!")  # a rollback wrote step 5 again
    (local / "step-00000005" / "manifest.json").write_text(json.dumps({"files": rels, "generation": 2}))
    tier.upload(local, "step-00000005", rels)
    assert (remote / "step-00000005" / "rank00000.bin").read_bytes() == b"new!"
    assert tier.committed() == ["step-00000005"]


@pytest.mark.parametrize("bad", ["../escape.bin", "/etc/passwd", "step-00000001/../../x", "", "a\\..\\b"])
def test_paths_that_escape_the_root_are_rejected(tier: PersistentTier, local: Path, bad: str):
    rels = write_step(local, "step-00000001", {"rank00000.bin": b"x"})
    with pytest.raises(CheckpointError, match="must be relative"):
        tier.upload(local, "step-00000001", [*rels, bad])
    with pytest.raises(CheckpointError, match="must be relative"):
        tier.fetch([bad], local)
    with pytest.raises(CheckpointError, match="must be relative"):
        tier.read_bytes(bad)
    for step in ("../step-00000001", "step-00000001/x", "latest"):
        with pytest.raises(CheckpointError, match="step name"):
            tier.delete(step)


def test_transient_errors_are_retried_within_a_bound(
    remote: Path, local: Path, monkeypatch: pytest.MonkeyPatch
):
    slept: list[float] = []
    tier = PersistentTier(f"file://{remote}", retry_attempts=3, retry_sleep=slept.append)
    rels = write_step(local, "step-00000001", {"rank00000.bin": b"x" * 8})
    put = tier.fs.put_file
    failures = iter([ConnectionError("reset by peer")] * 2)

    def flaky(src: str, dst: str, **kw: Any) -> None:
        if (e := next(failures, None)) is not None:
            raise e
        put(src, dst, **kw)

    monkeypatch.setattr(tier.fs, "put_file", flaky)
    tier.upload(local, "step-00000001", rels)
    assert len(slept) == 2 and tier.committed() == ["step-00000001"]

    def down(src: str, dst: str, **kw: Any) -> None:
        raise ConnectionError("store unreachable")

    monkeypatch.setattr(tier.fs, "put_file", down)
    slept.clear()
    rels = write_step(local, "step-00000002", {"rank00000.bin": b"y"})
    with pytest.raises(CheckpointError, match=r"step-00000002/rank00000\.bin.*store unreachable"):
        tier.upload(local, "step-00000002", rels)
    assert len(slept) == 2  # three attempts, then give up
    assert tier.committed() == ["step-00000001"]


def test_a_short_download_never_appears_under_the_final_name(
    tier: PersistentTier, local: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    rels = write_step(local, "step-00000001", {"rank00000.bin": b"z" * 1000})
    tier.upload(local, "step-00000001", rels)

    def truncated(rpath: str, lpath: str, **kw: Any) -> None:
        Path(lpath).write_bytes(b"z" * 10)  # the connection dropped, but no error was raised

    monkeypatch.setattr(tier.fs, "get_file", truncated)
    fresh = tmp_path / "fresh"
    with pytest.raises(CheckpointError, match="downloaded 10 of 1000 bytes"):
        tier.fetch(["step-00000001/rank00000.bin"], fresh)
    assert not [p for p in fresh.rglob("*") if p.is_file()]


# --- a real S3-compatible server ---------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def s3_endpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wait_until: Any) -> Iterator[str]:
    pytest.importorskip("moto.server", reason="moto[server] is not installed")
    s3fs = pytest.importorskip("s3fs", reason="s3fs is not installed")
    for var, value in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"}.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    port = free_port()
    binary = Path(sys.executable).with_name("moto_server")
    cmd = [str(binary)] if binary.exists() else [sys.executable, "-m", "moto.server"]
    endpoint = f"http://127.0.0.1:{port}"
    with open(tmp_path / "moto.log", "wb") as log:
        proc = subprocess.Popen([*cmd, "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=log)

    def answers() -> bool:
        try:
            urllib.request.urlopen(endpoint, timeout=1.0).close()
        except urllib.error.HTTPError:
            pass  # it answered HTTP
        except OSError:
            if proc.poll() is not None:
                pytest.fail(f"moto_server did not come up: {(tmp_path / 'moto.log').read_text()}")
            return False
        return True

    try:
        wait_until(answers, 30.0, lambda: f"moto_server to come up: {(tmp_path / 'moto.log').read_text()}")
        fs = s3fs.S3FileSystem(key="test", secret="test", endpoint_url=endpoint, skip_instance_cache=True)
        fs.mkdir("ckpt")
        yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
        s3fs.S3FileSystem.clear_instance_cache()


def test_s3_round_trip_against_a_real_server(s3_endpoint: str, local: Path, tmp_path: Path):
    tier = PersistentTier("s3://ckpt/run-1", key="test", secret="test", endpoint_url=s3_endpoint)
    s1 = write_step(local, "step-00000001", {"rank00000.bin": os.urandom(1 << 20)})
    s2 = write_step(
        local,
        "step-00000002",
        {"rank00000.bin": os.urandom(3 << 20), "dcp/shard.distcp": os.urandom(2 << 20 | 7)},
        refs=("step-00000001/rank00000.bin",),
    )
    assert tier.committed() == []
    tier.upload(local, "step-00000001", s1)
    tier.upload(local, "step-00000002", s2)
    assert tier.committed() == ["step-00000001", "step-00000002"]

    other = PersistentTier("s3://ckpt/run-1", key="test", secret="test", endpoint_url=s3_endpoint)
    fresh = tmp_path / "fresh"
    other.fetch(s2, fresh)
    assert_same(local, fresh, s2)

    other.delete("step-00000002")
    assert tier.committed() == ["step-00000001"]
    assert not tier.fs.exists("ckpt/run-1/step-00000002")


# --- the background uploader -----------------------------------------------------------------


def test_failed_upload_surfaces_on_future_submit_and_close(local: Path, tmp_path: Path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a regular file where the store's root should be")
    rels = write_step(local, "step-00000001", {"rank00000.bin": b"x"})
    up = AsyncUploader(PersistentTier(f"file://{blocker}", retry_sleep=no_sleep))
    fut = up.submit(local, "step-00000001", rels)
    with pytest.raises(CheckpointError, match="step-00000001"):
        fut.result(timeout=10)
    with pytest.raises(CheckpointError, match="earlier upload failed for step-00000001"):
        up.submit(local, "step-00000001", rels)
    with pytest.raises(CheckpointError, match="closing the uploader: upload failed for step-00000001"):
        up.close(timeout=10)
    up.close(timeout=10)  # idempotent
    with pytest.raises(CheckpointError, match="closed"):
        up.submit(local, "step-00000001", rels)


def test_close_flushes_queued_uploads(tier: PersistentTier, local: Path, monkeypatch: pytest.MonkeyPatch):
    steps = {
        f"step-{i:08d}": write_step(local, f"step-{i:08d}", {"r.bin": os.urandom(1000)}) for i in range(4)
    }
    gate = threading.Event()
    upload = tier.upload

    def gated(*args: Any) -> None:
        assert gate.wait(timeout=10)
        upload(*args)

    monkeypatch.setattr(tier, "upload", gated)
    up = AsyncUploader(tier)
    futures = [up.submit(local, step, rels) for step, rels in steps.items()]
    with pytest.raises(CheckpointError, match="still running"):
        up.close(timeout=0.05)  # the store is stuck: close says so instead of hanging
    assert not any(f.done() for f in futures)
    gate.set()
    up.close(timeout=10)
    assert all(f.done() and f.exception() is None for f in futures)
    assert tier.committed() == list(steps)


def test_uploader_is_a_context_manager(tier: PersistentTier, local: Path):
    rels = write_step(local, "step-00000001", {"r.bin": b"r"})
    with AsyncUploader(tier) as up:
        fut = up.submit(local, "step-00000001", rels)
    assert fut.done() and tier.committed() == ["step-00000001"]


# --- through the Checkpointer: local first, persistent when the local copy is gone ------------------


def _checkpointer_round_trip(url: str, local_root: Path, **options: Any) -> None:
    import torch

    from resilient.checkpoint.manager import Checkpointer

    x = torch.arange(300_000, dtype=torch.float32)
    with Checkpointer(local_root, token="t", keep=2, persistent_url=url, storage_options=options) as ck:
        for step in (1, 2, 3):
            ck.save(step, {"x": x + step})
    tier = PersistentTier(url, **options)
    assert tier.committed() == ["step-00000002", "step-00000003"]  # remote retention: keep=2
    shutil.rmtree(local_root)  # the node's disk is gone
    with Checkpointer(local_root, token="u", persistent_url=url, storage_options=options) as ck:
        loaded = ck.load_latest()
    assert loaded is not None and loaded.step == 3 and torch.equal(loaded.state["x"], x + 3)
    assert not (local_root / ".persistent-cache").exists()


def test_checkpointer_falls_back_to_the_file_tier(tmp_path: Path) -> None:
    _checkpointer_round_trip(f"file://{tmp_path / 'remote'}", tmp_path / "local")


def test_checkpointer_falls_back_to_s3(s3_endpoint: str, tmp_path: Path) -> None:
    _checkpointer_round_trip(
        "s3://ckpt/job", tmp_path / "local", key="test", secret="test", endpoint_url=s3_endpoint
    )
