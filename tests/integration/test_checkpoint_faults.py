"""Checkpoints under real faults: SIGKILLed writers, corrupt files, a full disk, preemption signals."""

from __future__ import annotations

import contextlib
import json
import os
import random
import selectors
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from resilient.checkpoint.manager import Checkpointer
from resilient.checkpoint.manifest import committed_steps, tmp_dirs
from resilient.checkpoint.reader import load_latest
from resilient.checkpoint.shm import ShmSnapshot
from resilient.errors import CheckpointError, ExitCode
from tests._wait import wait_until
from tests.integration.conftest import STEPS, assert_bit_exact, load_states, run_example

pytestmark = pytest.mark.integration
WORKER = str(Path(__file__).with_name("_ckpt_worker.py"))
ROOT = Path(__file__).resolve().parents[2]


def _state_at(step: int) -> dict[str, object]:
    sys.path.insert(0, str(Path(WORKER).parent))
    try:
        from _ckpt_worker import state_at  # type: ignore[import-not-found]
    finally:
        sys.path.pop(0)
    return dict(state_at(step))


def _assert_state(got: dict[str, object], step: int) -> None:
    want = _state_at(step)
    assert got["meta"] == want["meta"]
    for k in ("frozen", "weights"):
        assert torch.equal(got[k], want[k]), k  # type: ignore[arg-type]


class Worker:
    """The worker script as a real process in its own session; killed by process group at the end."""

    def __init__(self, *args: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        self.p = subprocess.Popen(
            [sys.executable, WORKER, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        self.sel = selectors.DefaultSelector()
        assert self.p.stdout is not None
        self.sel.register(self.p.stdout, selectors.EVENT_READ)
        self.last = 0

    def wait_for(self, n: int, timeout: float = 60.0) -> None:
        """Block until the worker reports at least ``n`` completed steps."""
        wait_until(
            lambda: self._read_reports(n) >= n,
            timeout,
            lambda: f"the worker to report {n} steps (it reported {self.last})",
        )

    def _read_reports(self, n: int) -> int:
        """The steps reported so far, after reading the lines the worker has written (up to step
        ``n``) without blocking; fails at once if the worker exited."""
        assert self.p.stdout is not None
        while self.last < n and self.sel.select(0):
            line = self.p.stdout.readline()
            if not line:
                err = self.p.stderr.read() if self.p.stderr else ""
                raise AssertionError(f"worker exited rc={self.p.wait()}:\n{err[-3000:]}")
            self.last = int(line.split()[1])
        return self.last

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.p.pid, signal.SIGKILL)
        self.p.wait()
        self.sel.close()
        for f in (self.p.stdout, self.p.stderr):
            if f is not None:
                f.close()


def test_sigkilled_writer_never_loses_the_last_committed_checkpoint(tmp_path: Path) -> None:
    rng = random.Random(1234)
    root = tmp_path / "ck"
    mid_save = 0

    def kill_one(mid_write: bool) -> None:
        nonlocal mid_save
        w = Worker("ckpt", str(root))
        try:
            w.wait_for(w.last + 1 if committed_steps(root) else 1)
            if mid_write:  # as soon as a save's uncommitted directory is there: a torn write
                wait_until(lambda: tmp_dirs(root), 30, "a save in progress", interval=0.002)
            else:  # a random point: saves run back to back
                time.sleep(rng.uniform(0.0, 0.25))
            os.killpg(w.p.pid, signal.SIGKILL)
        finally:
            w.kill()
        mid_save += bool(tmp_dirs(root))
        loaded = load_latest(root)
        assert loaded is not None and loaded.step >= w.last
        _assert_state(loaded.state, loaded.step)

    for _ in range(6):
        kill_one(mid_write=False)
    for _ in range(10):  # a loaded machine may have let every random kill fall between saves
        if mid_save >= 2:
            break
        kill_one(mid_write=True)
    assert mid_save >= 1, "no kill landed inside a save; the test did not exercise a torn write"


def test_shm_snapshot_survives_sigkill_of_its_writer() -> None:
    name = f"test-{uuid.uuid4().hex[:8]}"
    snap = ShmSnapshot(name)
    w = Worker("shm", name)
    try:
        w.wait_for(3)
        time.sleep(random.Random(7).uniform(0.0, 0.2))
        os.killpg(w.p.pid, signal.SIGKILL)
        w.kill()
        t0 = time.perf_counter()
        got = snap.load()
        load_s = time.perf_counter() - t0
        assert got is not None
        step, state = got
        assert step >= w.last
        _assert_state(state, step)
        assert load_s < 5.0, f"restoring 6 MB from shared memory took {load_s:.2f}s"
    finally:
        w.kill()
        snap.unlink()
    assert not snap.top.exists()


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A real 3 MiB tmpfs mounted by the test (root only), unmounted even if the test fails."""
    where = tmp_path / "small"
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(where)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a size-limited tmpfs here (needs root): {r.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_disk_full_reports_checkpoint_error_and_keeps_older_checkpoints(small_fs: Path) -> None:
    x = torch.zeros(256 << 10)  # 1 MiB per checkpoint; the filesystem holds 3 MiB
    errors: list[str] = []
    ck = Checkpointer(small_fs, token="t", keep=10, incremental=False)
    for step in range(1, 7):  # the training loop keeps going whatever the disk does
        x.fill_(step)
        try:
            ck.save(step, {"x": x})
            ck.wait()
        except CheckpointError as e:
            errors.append(str(e))
    with pytest.raises(CheckpointError) as last:
        ck.save(7, {"x": x})
        ck.close()
    errors.append(str(last.value))
    assert errors and all("No space left on device" in e for e in errors), errors
    assert committed_steps(small_fs)[:1] == [2], committed_steps(small_fs)
    assert not tmp_dirs(small_fs), "a failed save left its partial files behind"
    loaded = load_latest(small_fs)
    assert loaded is not None and loaded.step == 2 and bool((loaded.state["x"] == 2).all())


def _wait_event(path: Path, name: str, min_step: int, timeout: float = 60.0) -> None:
    def logged() -> bool:  # another process writes the log: poll it
        if path.exists():
            for line in path.read_text().splitlines():
                e = json.loads(line)
                if e["event"] == name and (e.get("step") or 0) >= min_step:
                    return True
        return False

    wait_until(logged, timeout, f"a {name} event with step >= {min_step} in {path}")


def test_sigusr1_writes_final_checkpoint_exits_requeue_and_resumes_bit_exact(
    tmp_path: Path, reference: dict[int, list[dict[str, object]]]
) -> None:
    ck = tmp_path / "ck"
    first = tmp_path / "first"

    def preempt(procs: list[subprocess.Popen[str]]) -> None:
        runs = first / "resilient_runs"
        wait_until(lambda: runs.exists() and any(runs.iterdir()), 60, "the run to start")
        events = next(runs.iterdir()) / "events.jsonl"
        _wait_event(events, "checkpoint_saved", 8)
        for p in procs:  # like Slurm's --signal: every task gets it
            os.kill(p.pid, signal.SIGUSR1)

    args = ("--ckpt-dir", str(ck), "--ckpt-every", "4")
    res = run_example(first, 2, *args, "--step-ms", "60", on_start=preempt)
    assert [r.returncode for r in res.ranks] == [ExitCode.REQUEUE] * 2, res.describe()
    pre = res.of("run_preempted")
    assert len(pre) == 2 and pre[0]["step"] == pre[1]["step"], pre
    final = pre[0]["step"]
    assert 8 <= final < STEPS and committed_steps(ck)[0] == final
    second = tmp_path / "second"
    res2 = run_example(second, 2, *args)
    assert res2.ok, res2.describe()
    assert [e["step"] for e in res2.of("checkpoint_loaded")] == [final, final]
    assert_bit_exact(reference[2], load_states(second, 2))


def test_a_preemption_seen_by_one_rank_first_stops_every_rank_without_a_stall(
    tmp_path: Path, reference: dict[int, list[dict[str, object]]]
) -> None:
    # Slurm signals each node on its own: one rank sees the preemption at a step boundary its peers
    # have passed already (here: only rank 0 is signalled). It must not wait there for a peer's
    # collective count the peer will never post (the peer waits in the next step's all-reduce for
    # it): every rank stops, the final checkpoint is one every rank holds, and it resumes exact.
    ck = tmp_path / "ck"
    first = tmp_path / "first"

    def preempt_rank0(procs: list[subprocess.Popen[str]]) -> None:
        runs = first / "resilient_runs"
        wait_until(lambda: runs.exists() and any(runs.iterdir()), 60, "the run to start")
        _wait_event(next(runs.iterdir()) / "events.jsonl", "checkpoint_saved", 8)
        os.kill(procs[0].pid, signal.SIGUSR1)

    args = ("--ckpt-dir", str(ck), "--ckpt-every", "4")
    res = run_example(first, 2, *args, "--step-ms", "60", "--hang-timeout", "60", on_start=preempt_rank0)
    assert [r.returncode for r in res.ranks] == [ExitCode.REQUEUE] * 2, res.describe()
    # no rank sat in a wait its peer could not end (a hang, or a desync once the hang timeout hit)
    assert {e["kind"] for e in res.of("fault_detected")} == {"preempt"}, res.of("fault_detected")
    pre = res.of("run_preempted")
    assert len(pre) == 2 and pre[0]["step"] == pre[1]["step"], pre
    final = pre[0]["step"]
    assert committed_steps(ck)[0] == final
    second = tmp_path / "second"
    res2 = run_example(second, 2, *args)
    assert res2.ok, res2.describe()
    assert [e["step"] for e in res2.of("checkpoint_loaded")] == [final, final]
    assert_bit_exact(reference[2], load_states(second, 2))
