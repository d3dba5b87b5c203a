"""The runtime's checkpoint schedule (fixed and adaptive) and its preemption signal handling."""

from __future__ import annotations

import math
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from resilient.config import CheckpointConfig, load_config
from resilient.errors import ConfigError
from resilient.events import EventLog, read_events
from resilient.runtime.keeping.durable import Persistence


def _persist(tmp_path: Path, **cfg: object) -> Persistence:
    config = CheckpointConfig(dir=tmp_path / "ck", **cfg)  # type: ignore[arg-type]
    return Persistence(
        config,
        rank=0,
        world_size=1,
        token="t",
        events=EventLog(tmp_path / "events.jsonl", 0),
        exchange=lambda name, payload: [payload],  # one rank: the store exchange returns our payload
    )


def test_fixed_interval_saves_every_n_steps(tmp_path: Path) -> None:
    p = _persist(tmp_path, interval=5)
    assert [s for s in range(1, 21) if p.due(s) and (p._plan_next(s, 0) or True)] == [5, 10, 15, 20]
    p.ckpt.close()


def test_auto_interval_follows_young_from_measured_write_time_and_fault_rate(tmp_path: Path) -> None:
    p = _persist(tmp_path, interval="auto", mtbf_s=86400.0)
    p._write_s, p._step_s = 2.0, 0.1
    p._plan_next(100, faults_seen=0)  # no fault yet: the prior MTBF
    assert p.next_save == 100 + round(math.sqrt(2 * 2.0 * 86400) / 0.1)
    p._t0 = time.monotonic() - 400.0  # 4 faults in 400 s: MTBF 100 s
    p._plan_next(200, faults_seen=4)
    assert p.next_save is not None and abs((p.next_save - 200) - math.sqrt(2 * 2.0 * 100) / 0.1) <= 1
    p.ckpt.close()


def test_preempt_signal_sets_the_flag_and_uninstall_restores_the_handler(tmp_path: Path) -> None:
    p = _persist(tmp_path)
    before = signal.getsignal(signal.SIGUSR1)
    p.install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)  # a real signal, handled on the main thread
        assert p.preempt_requested == "SIGUSR1"
    finally:
        p.uninstall()
        p.ckpt.close()
    assert signal.getsignal(signal.SIGUSR1) == before


def test_preempt_signal_may_not_be_the_interrupt_signal() -> None:
    with pytest.raises(ConfigError, match="preempt_signals contains SIGUSR2"):
        load_config(None, checkpoint={"preempt_signals": ["SIGUSR2"]})


def test_bad_checkpoint_interval_is_named() -> None:
    with pytest.raises(ConfigError, match=r"checkpoint\.interval"):
        load_config(None, checkpoint={"interval": 0})


def _flip(shard: Path) -> None:
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


def test_resume_quarantines_what_fails_and_falls_back_to_the_persistent_tier(tmp_path: Path) -> None:
    import torch

    remote = tmp_path / "remote"
    p = _persist(tmp_path, interval=1, keep=2, persistent_url=f"file://{remote}")
    for step in (1, 2):
        p.save(step, {"x": torch.full((256,), float(step))}, 0, 0)
        p.ckpt.wait()
    p.ckpt.close()
    for step in (1, 2):  # every local copy is corrupt; the uploaded ones are intact
        _flip(tmp_path / "ck" / f"step-{step:08d}" / "rank00000.bin")
    q = _persist(tmp_path, interval=1, keep=2, persistent_url=f"file://{remote}")
    loaded = q.resume()
    assert loaded is not None and loaded.step == 2 and torch.equal(loaded.state["x"], torch.full((256,), 2.0))
    q.ckpt.close()
    events = (tmp_path / "events.jsonl").read_text()
    assert events.count('"checkpoint_rejected"') == 2 and '"checkpoint_loaded"' in events


def test_resume_with_nothing_valid_anywhere_is_fatal_and_names_each_checkpoint(tmp_path: Path) -> None:
    import torch

    from resilient.errors import ExitCode, NoValidCheckpoint

    p = _persist(tmp_path, interval=1)
    p.save(1, {"x": torch.ones(256)}, 0, 0)
    p.ckpt.close()
    _flip(tmp_path / "ck" / "step-00000001" / "rank00000.bin")
    with pytest.raises(NoValidCheckpoint, match=r"step-00000001: .*rank00000.bin") as e:
        _persist(tmp_path, interval=1).resume()
    assert e.value.exit_code == ExitCode.FATAL
    assert (tmp_path / "ck" / "step-00000001").is_dir()  # left in place for the person who fixes it


def test_ranks_that_saved_different_steps_agree_again_after_a_restore(tmp_path: Path) -> None:
    """A fault can stop one rank before a save its peer completed; resumed at the agreed step,
    both count the next save from there (else one waits at a save the other never makes)."""
    saved, interrupted = _persist(tmp_path / "a", interval=10), _persist(tmp_path / "b", interval=10)
    saved._plan_next(20, 0)  # rank 0 saved step 20; rank 1 was interrupted in the step before
    assert (saved.next_save, interrupted.next_save) == (30, 10)
    for p in (saved, interrupted):
        p.rebase(8)
    assert [s for s in range(9, 40) if saved.due(s)] == [s for s in range(9, 40) if interrupted.due(s)]
    assert saved.next_save == interrupted.next_save == 18
    saved.ckpt.close()
    interrupted.ckpt.close()


def test_a_sigterm_not_from_the_agent_is_a_preemption_and_the_agents_stops_the_process(
    tmp_path: Path,
) -> None:
    # under resilient launch, Slurm's SIGTERM (a requeue, scancel, a node failure: every process of
    # the job step gets one) asks for the final checkpoint; the agent's own (the stopping mark set
    # first) goes to the handler there was before, as always
    import os
    import signal

    from resilient.contract import agent_stopping, mark_stopping

    hb = tmp_path / "hb"
    hb.mkdir()
    before: list[int] = []
    old = signal.signal(signal.SIGTERM, lambda signum, frame: before.append(signum))
    p = Persistence(
        CheckpointConfig(dir=tmp_path / "ck"), rank=0, world_size=1, token="t",
        events=EventLog(tmp_path / "events.jsonl", 0), exchange=lambda name, payload: [payload],
        signals=("SIGUSR1",), agent_stopping=lambda: agent_stopping(hb),
    )  # fmt: skip
    try:
        p.install()
        os.kill(os.getpid(), signal.SIGTERM)
        assert p.preempt_requested == "SIGTERM" and before == []
        p.preempt_requested = None
        mark_stopping(hb, True)
        os.kill(os.getpid(), signal.SIGTERM)
        assert p.preempt_requested is None and before == [signal.SIGTERM]
        mark_stopping(hb, False)
        assert not agent_stopping(hb)
    finally:
        p.uninstall()
        signal.signal(signal.SIGTERM, old)


def test_the_agents_sigterm_watch_passes_signals_on_and_leaves_no_trace(tmp_path: Path) -> None:
    # the watch that ends a process blocked in C on its agent's SIGTERM reads the signal wakeup fd:
    # one set before (an event loop's) still gets every signal's byte, and has its place back after
    r, w = os.pipe()
    os.set_blocking(w, False)
    hb = tmp_path / "hb"
    hb.mkdir()
    p = Persistence(
        CheckpointConfig(dir=tmp_path / "ck"), rank=0, world_size=1, token="t",
        events=EventLog(tmp_path / "events.jsonl", 0), exchange=lambda name, payload: [payload],
        signals=("SIGUSR1",), agent_stopping=lambda: False,
    )  # fmt: skip
    before = signal.set_wakeup_fd(w)
    try:
        p.install()
        assert p._term_watch is not None and p._term_watch.is_alive()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert os.read(r, 1) == bytes([signal.SIGUSR1]) and p.preempt_requested == "SIGUSR1"
        watch = p._term_watch
        p.uninstall()
        assert not watch.is_alive()
        assert signal.set_wakeup_fd(-1) == w
    finally:
        signal.set_wakeup_fd(before)
        p.ckpt.close()
        os.close(r)
        os.close(w)


def test_a_save_the_faulted_rank_never_reaches_is_given_up_at_once_not_at_its_commit_timeout(
    tmp_path: Path,
) -> None:
    """Rank 0 saved step 20 while rank 1 faulted in step 19: rank 1's part never comes. The
    recovery's settle says so, and rank 0's commit fails now (reported) instead of in 600 s."""
    config = CheckpointConfig(dir=tmp_path / "ck", interval=10, commit_timeout_s=600)
    p = Persistence(
        config,
        rank=0,
        world_size=2,
        token="t",
        events=EventLog(tmp_path / "events.jsonl", 0),
        exchange=lambda name, payload: [payload, payload],
    )
    p.ckpt.save(20, {"model": {"w": torch.ones(4)}})
    assert p.ckpt.in_flight() is not None  # (waiting for rank 1's part)
    t0 = time.monotonic()
    p.settle(0, 19, fault=(1, 19))
    assert time.monotonic() - t0 < 30  # (its commit timeout is 600 s)
    (failed,) = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "checkpoint_failed"]
    assert "rank 1" in failed["error"] and "step 19" in failed["error"], failed
    assert p.failures == 1
    p.ckpt.close()
