"""Checkpointer in one process: round trip, commit layout, incremental, retention, fallback, safety."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import pickle
import random
import shutil
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from resilient.checkpoint.codec import decode, encode
from resilient.checkpoint.manager import Checkpointer
from resilient.checkpoint.manifest import MANIFEST, committed_steps, manifest_digest, step_name
from resilient.checkpoint.procwriter import ProcessWriter
from resilient.checkpoint.reader import load_latest, load_step
from resilient.errors import CheckpointError, ExitCode
from resilient.state.registry import Registry


def _model_state(seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3)
    model(torch.randn(5, 8)).sum().backward()
    opt.step()
    sched.step()
    reg = Registry()
    reg.add("model", model)
    reg.add("optim", opt)
    reg.add("sched", sched)
    return reg.capture()


def _equal(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _equal(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _equal(x, y)
    else:
        assert a == b or (a != a and b != b), (a, b)


def _plain(state: dict[str, Any]) -> dict[str, Any]:
    """The registry's Frozen RNG leaves unwrapped, as a loaded checkpoint returns them."""
    skeleton, leaves = encode(state)
    return decode(skeleton, [leaf.tensor for leaf in leaves])


def test_codec_round_trips_optimizer_scheduler_and_every_rng() -> None:
    state = _model_state()
    state["misc"] = {3: (1, 2.5, None), "b": b"\x00\x01", "dt": torch.bfloat16, "nan": float("nan")}
    skeleton, leaves = encode(state)
    json.dumps(skeleton)  # the skeleton is plain JSON
    _equal(_plain(state), decode(json.loads(json.dumps(skeleton)), [leaf.tensor for leaf in leaves]))


def test_codec_names_the_path_of_an_unsupported_leaf() -> None:
    with pytest.raises(CheckpointError, match=r"/data/sampler: object"):
        encode({"data": {"sampler": object()}})


def test_save_commits_manifest_and_loads_bit_exact(tmp_path: Path) -> None:
    state = _model_state()
    with Checkpointer(tmp_path, token="t") as ck:
        fut = ck.save(7, state, extra={"note": "x"})
        assert fut is not None
        manifest = fut.result()
    assert manifest is not None and manifest.step == 7 and manifest.world_size == 1
    assert committed_steps(tmp_path) == [7]
    assert sorted(p.name for p in (tmp_path / step_name(7)).iterdir()) == [MANIFEST, "rank00000.bin"]
    loaded = load_latest(tmp_path, 0, 1)
    assert loaded is not None and loaded.step == 7 and loaded.manifest.extra == {"note": "x"}
    _equal(_plain(state), loaded.state)


def test_staged_copy_is_taken_at_save_time(tmp_path: Path) -> None:
    t = torch.arange(1000, dtype=torch.float32)
    with Checkpointer(tmp_path, token="t") as ck:
        ck.save(1, {"t": t})
        t.add_(1)  # the caller continues training while the writer persists
    loaded = load_latest(tmp_path)
    assert loaded is not None and torch.equal(loaded.state["t"], torch.arange(1000, dtype=torch.float32))


def test_incremental_save_references_unchanged_tensors(tmp_path: Path) -> None:
    frozen = torch.randn(256, 256)
    live = torch.zeros(16)
    with Checkpointer(tmp_path, token="t", keep=1) as ck:
        ck.save(1, {"frozen": frozen, "live": live})
        ck.wait()
        live.add_(1)
        ck.save(2, {"frozen": frozen, "live": live})
        ck.wait()
        m = ck.manifest(2)
    entries = {t.key: t for t in m.rank(0).tensors}
    assert entries["/frozen"].file == f"{step_name(1)}/rank00000.bin"
    assert entries["/live"].file == f"{step_name(2)}/rank00000.bin"
    assert (tmp_path / step_name(2) / "rank00000.bin").stat().st_size < 1024  # only `live` rewritten
    assert committed_steps(tmp_path) == [2, 1]  # keep=1, but step 1 is still referenced
    loaded = load_latest(tmp_path)
    assert loaded is not None
    assert torch.equal(loaded.state["frozen"], frozen) and torch.equal(loaded.state["live"], live)


def test_retention_keeps_last_n_and_drops_unreferenced(tmp_path: Path) -> None:
    x = torch.zeros(64)
    with Checkpointer(tmp_path, token="t", keep=2, incremental=False) as ck:
        for step in range(1, 6):
            x.add_(1)
            ck.save(step, {"x": x})
            ck.wait()
    assert committed_steps(tmp_path) == [5, 4]


def test_stale_tmp_of_a_dead_writer_is_removed(tmp_path: Path) -> None:
    stale = tmp_path / f"{step_name(3)}.deadbeef.tmp"
    stale.mkdir(parents=True)
    (stale / "rank00000.bin").write_bytes(b"half")
    with Checkpointer(tmp_path, token="t") as ck:
        assert not stale.exists()
        ck.save(4, {"x": torch.ones(3)})
    assert committed_steps(tmp_path) == [4]


@pytest.mark.parametrize("damage", ["flip", "truncate", "manifest"])
def test_corrupt_newest_falls_back_with_a_warning_naming_the_file(
    tmp_path: Path, damage: str, caplog_loguru: list[str]
) -> None:
    x = torch.arange(4096, dtype=torch.float64)
    with Checkpointer(tmp_path, token="t", incremental=False) as ck:
        ck.save(1, {"x": x})
        ck.wait()
        ck.save(2, {"x": x + 1})
    bad = tmp_path / step_name(2) / ("rank00000.bin" if damage != "manifest" else MANIFEST)
    data = bytearray(bad.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
    elif damage == "truncate":
        data = data[:-100]
    else:
        data = data[: len(data) // 2]
    bad.write_bytes(bytes(data))
    loaded = load_latest(tmp_path)
    assert loaded is not None and loaded.step == 1 and torch.equal(loaded.state["x"], x)
    assert any(str(bad) in m for m in caplog_loguru), caplog_loguru


def test_no_valid_checkpoint_lists_what_was_tried(tmp_path: Path) -> None:
    with Checkpointer(tmp_path, token="t") as ck:
        ck.save(1, {"x": torch.ones(8)})
    (tmp_path / step_name(1) / "rank00000.bin").write_bytes(b"junk")
    with pytest.raises(CheckpointError, match=r"tried:\n.*step-00000001.*rank00000.bin") as e:
        load_latest(tmp_path)
    assert e.value.exit_code == ExitCode.FATAL  # type: ignore[attr-defined]  # a relaunch reads the same bytes
    assert load_latest(tmp_path / "empty") is None


def test_a_rejected_checkpoint_leaves_the_committed_set_and_its_step_commits_again(tmp_path: Path) -> None:
    # found by the soak: a corrupt checkpoint that stayed "committed" was kept by retention in place
    # of good ones, and a replayed save of its step kept the bad copy; three corruptions in a row
    # left nothing loadable
    with Checkpointer(tmp_path, token="t", keep=2, incremental=False) as ck:
        for step in (1, 2):
            ck.save(step, {"x": torch.full((512,), float(step))})
            ck.wait()
    shard = tmp_path / step_name(2) / "rank00000.bin"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with Checkpointer(tmp_path, token="u", keep=2, incremental=False) as ck:
        loaded = ck.load_latest()
        assert loaded is not None and loaded.step == 1
        assert committed_steps(tmp_path) == [1]  # step 2 moved aside, kept for inspection
        assert len(list(tmp_path.glob(f"{step_name(2)}.rejected-*"))) == 1
        for step in (2, 3):  # the run replays step 2: it commits afresh, and retention counts it
            ck.save(step, {"x": torch.full((512,), float(step))})
            ck.wait()
    assert committed_steps(tmp_path) == [3, 2]
    assert torch.equal(load_step(tmp_path, 2, 0).state["x"], torch.full((512,), 2.0))


def test_manifest_path_escaping_the_directory_is_rejected(tmp_path: Path) -> None:
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"x" * 64)
    with Checkpointer(tmp_path / "ck", token="t") as ck:
        ck.save(1, {"x": torch.ones(8)})
    path = tmp_path / "ck" / step_name(1) / MANIFEST
    m = json.loads(path.read_text())
    m["ranks"][0]["files"][0]["path"] = "../secret.bin"
    m["ranks"][0]["tensors"][0]["file"] = "../secret.bin"
    m["digest"] = manifest_digest(m)  # (resealed: else the edit is refused as one before the path is read)
    path.write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match="escapes the checkpoint directory"):
        load_step(tmp_path / "ck", 1, 0)


def test_loading_never_unpickles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = _model_state()
    with Checkpointer(tmp_path, token="t") as ck:
        ck.save(1, state)

    def refuse(*a: Any, **k: Any) -> Any:
        raise AssertionError("unpickling during checkpoint load")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    loaded = load_latest(tmp_path)
    assert loaded is not None
    _equal(_plain(state), loaded.state)


def test_wrong_world_size_is_an_error_naming_both_sizes(tmp_path: Path) -> None:
    with Checkpointer(tmp_path, token="t") as ck:
        ck.save(1, {"x": torch.ones(2)})
    with pytest.raises(CheckpointError, match="written by 1 ranks, this job has 2"):
        load_latest(tmp_path, 0, 2)


def test_write_error_surfaces_on_next_save_and_on_close(tmp_path: Path) -> None:
    ck = Checkpointer(tmp_path / "ck", token="t")
    ck.save(1, {"x": torch.ones(4)})
    ck.wait()
    shutil.rmtree(tmp_path / "ck")
    (tmp_path / "ck").write_text("now a file")  # the directory is gone: every write fails for real
    ck.save(2, {"x": torch.ones(4)})
    with pytest.raises(CheckpointError, match="step-00000002 failed"):
        ck.save(3, {"x": torch.ones(4)})
    ck.save(4, {"x": torch.ones(4)})
    with pytest.raises(CheckpointError, match="step-00000004 failed"):
        ck.close()
    ck.close()  # idempotent


def test_a_write_that_fails_between_two_looks_still_surfaces(tmp_path: Path) -> None:
    """The save in flight fails after save() first looked at it but before save() decided whether
    it is busy: its error must still reach the caller, not be overwritten by the next save."""
    gate = threading.Event()

    class LateFailure(Checkpointer):
        def _settle(self, wait: bool) -> None:
            fut = self._inflight
            super()._settle(wait)
            if not wait and fut is not None and not gate.is_set():
                gate.set()  # let the write fail now, between the two looks
                concurrent.futures.wait([fut])

    ck = LateFailure(tmp_path / "ck", token="t")
    write = ck.writer.write

    def gated(job: Any) -> Any:
        gate.wait(10)
        return write(job)

    ck.writer.write = gated  # type: ignore[method-assign]
    shutil.rmtree(tmp_path / "ck", ignore_errors=True)
    (tmp_path / "ck").write_text("now a file")  # every write fails for real
    ck.save(2, {"x": torch.ones(4)})
    with pytest.raises(CheckpointError, match="step-00000002 failed"):
        ck.save(3, {"x": torch.ones(4)})
    ck.close()  # save(3) raised before it started: nothing is left in flight


def test_skip_policy_never_waits_for_the_disk(tmp_path: Path) -> None:
    big = torch.randn(8 << 20)  # 32 MB: the writer is still busy when the next save comes
    with Checkpointer(tmp_path, token="t", on_busy="skip") as ck:
        first = ck.save(1, {"x": big})
        second = ck.save(2, {"x": big})
        assert first is not None
        if second is None:
            assert ck.skipped == 1
    assert committed_steps(tmp_path)[-1] == 1


def test_pipelined_save_blocks_the_optimizer_until_staged(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(512, 512)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    expect = {k: v.clone() for k, v in model.state_dict().items()}
    with Checkpointer(tmp_path, token="t") as ck:
        ck.save(1, {"model": model.state_dict()}, pipeline=[opt])
        model(torch.randn(4, 512)).sum().backward()
        opt.step()  # must not run before the copy of the parameters finished
    loaded = load_latest(tmp_path)
    assert loaded is not None
    for k, v in expect.items():
        assert torch.equal(loaded.state["model"][k], v)
    assert not torch.equal(model.weight, expect["weight"])


def test_python_random_state_survives(tmp_path: Path) -> None:
    random.seed(5)
    state = _model_state()
    with Checkpointer(tmp_path, token="t") as ck:
        ck.save(1, state)
    expected = random.random()
    loaded = load_latest(tmp_path)
    assert loaded is not None
    random.setstate(loaded.state["__rng__"]["python"])
    assert random.random() == expected


def test_loaded_generator_state_restores_the_sequence(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(3)
    torch.rand(5, generator=g)
    reg = Registry()
    reg.add("data", g)
    with Checkpointer(tmp_path, token="t") as ck:
        ck.save(1, {"pad": torch.ones(100), **reg.capture()})  # the state is not first in its file
    expected = torch.rand(4, generator=g)
    loaded = load_latest(tmp_path)
    assert loaded is not None
    reg.load("data", loaded.state["data"])  # Generator.set_state misreads a view with an offset
    assert torch.equal(torch.rand(4, generator=g), expected)


def test_cli_lists_and_verifies_checkpoints(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from resilient.cli import main

    with Checkpointer(tmp_path, token="t", incremental=False) as ck:
        for step in (1, 2):
            ck.save(step, {"x": torch.full((1000,), float(step))})
            ck.wait()
    assert main(["checkpoints", str(tmp_path), "--verify"]) == 0
    assert "✓" in capsys.readouterr().out
    bad = tmp_path / step_name(1) / "rank00000.bin"
    data = bytearray(bad.read_bytes())
    data[10] ^= 1
    bad.write_bytes(bytes(data))
    assert main(["checkpoints", str(tmp_path), "--verify"]) == 1
    assert "checksum mismatch" in capsys.readouterr().out


# --- the writer as a child process -----------------------------------------------------------------


def test_process_writer_round_trip_incremental_and_cleanup(tmp_path: Path) -> None:
    state = _model_state()
    frozen = torch.randn(256, 256)
    with Checkpointer(tmp_path / "ck", token="t", writer="process") as ck:
        ck.save(1, {"s": state, "frozen": frozen})
        ck.wait()
        ck.save(2, {"s": state, "frozen": frozen})
        ck.wait()
        arena = ck.writer.arena.path
        assert arena is not None and arena.exists()
        m = ck.manifest(2)
    assert arena is not None and not arena.exists()  # the /dev/shm staging file is removed on close
    assert {t.key: t.file for t in m.rank(0).tensors}["/frozen"].startswith(step_name(1))
    loaded = load_latest(tmp_path / "ck")
    assert loaded is not None and loaded.step == 2
    _equal(_plain({"s": state, "frozen": frozen}), loaded.state)


def test_process_writer_death_is_a_checkpoint_error(tmp_path: Path) -> None:
    import signal as _signal

    ck = Checkpointer(tmp_path, token="t", writer="process")
    try:
        ck.save(1, {"x": torch.ones(4)})
        ck.wait()
        assert isinstance(ck.writer, ProcessWriter)
        ck.writer._proc.send_signal(_signal.SIGKILL)  # a real kill of the writer process
        ck.writer._proc.wait()
        ck.save(2, {"x": torch.ones(4)})
        with pytest.raises(CheckpointError, match="writer process died"):
            ck.wait()
    finally:
        ck.close()
    assert committed_steps(tmp_path) == [1]


def test_a_step_replayed_after_a_failed_commit_is_saved_afresh_on_every_rank(tmp_path: Path) -> None:
    """A recovery replays a step whose save rank 2 had finished but whose commit failed (rank 1
    died; its replacement reported it): rank 0 discarded the directory, rank 2's part with it.
    Once every rank forgot what did not commit, the replayed save commits; a rank that returned
    its earlier save instead would leave rank 0 waiting for a part that never comes."""
    x = torch.arange(8.0)
    kw: dict[str, Any] = {"token": "t", "world_size": 3, "commit_timeout_s": 5.0}
    ranks = [Checkpointer(tmp_path, rank=r, **kw) for r in range(3)]
    try:
        ranks[2].save(5, {"x": x + 2})
        ranks[2].wait()
        from resilient.checkpoint.writer import report_failure

        report_failure(tmp_path, 5, "t", 1, RuntimeError("the rank's process died"))
        ranks[0].save(5, {"x": x})
        with pytest.raises(CheckpointError, match="rank 1 failed"):
            ranks[0].wait()
        assert committed_steps(tmp_path) == []
        for ck in ranks:  # the recovery, every rank settled
            ck.forget_unfinished()
        futures = [ck.save(5, {"x": x + r}) for r, ck in enumerate(ranks)]
        assert all(f is not None for f in futures)
        manifest = futures[0].result(timeout=10)  # type: ignore[union-attr]
        assert manifest is not None and committed_steps(tmp_path) == [5]
        for r in range(3):
            loaded = load_latest(tmp_path, r, 3)
            assert loaded is not None and torch.equal(loaded.state["x"], x + r)
        # replayed again after a later recovery: committed, so every rank skips it alike
        for ck in ranks:
            ck.forget_unfinished()
        again = [ck.save(5, {"x": x}) for ck in ranks]
        assert all(f is not None and f.done() for f in again)
        assert again[0].result().step == 5  # type: ignore[union-attr]
        assert not list(tmp_path.glob("*.tmp"))
    finally:
        for ck in ranks:
            with contextlib.suppress(CheckpointError):
                ck.close()
