"""The agent's death watch: a worker's exit wakes the agent's loop when the kernel reports it."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from resilient.launcher.deaths import DeathWatch, WakeableTime


def test_a_wake_ends_the_loops_sleep_at_once() -> None:
    clock = WakeableTime()
    threading.Timer(0.05, clock.wake).start()
    t0 = time.monotonic()
    clock.sleep(30)
    assert time.monotonic() - t0 < 10
    assert clock.monotonic() > 0  # the rest of the time module passes through


@pytest.mark.skipif(not DeathWatch.available(), reason="no os.pidfd_open on this platform")
def test_an_exit_is_reported_without_waiting_for_a_poll() -> None:
    # a process that lives until its stdin closes: its end is an event the test causes
    p = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    died = threading.Event()
    watch = DeathWatch(lambda: [p.pid], died.set, refresh_s=30.0)  # (no refresh helps it)
    try:
        if not watch.start():
            pytest.skip("pidfd_open is refused by this kernel")
        # the watch holds the pid's fd before the process ends (else it could only see it at a refresh)
        assert watch.synced.wait(10)
        assert not died.is_set()
        assert p.stdin is not None
        p.stdin.close()
        assert died.wait(10), "the exit was not reported"
        p.wait(10)
    finally:
        watch.close()
        if p.poll() is None:
            p.kill()
            p.wait()


class _FrozenClock:
    """The time module's ``monotonic`` at a fixed instant; its event records how long it waited."""

    def __init__(self, now: float) -> None:
        self.now = now
        self.waited: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def wait(self, seconds: float) -> bool:
        self.waited.append(seconds)
        return False

    def clear(self) -> None:
        pass


def test_the_loops_sleep_ends_at_the_next_heartbeat_deadline_not_at_the_poll() -> None:
    fake = _FrozenClock(100.0)
    clock = WakeableTime(fake)  # type: ignore[arg-type]
    clock._event = fake  # type: ignore[assignment]
    due: list[float | None] = [100.03]
    clock.deadline = lambda: due[0]
    clock.sleep(0.1)
    due[0] = 99.0  # one already passed: the poll acts on it, the sleep is not cut to nothing
    clock.sleep(0.1)
    due[0] = None  # nobody to wait for
    clock.sleep(0.1)
    due[0] = 250.0  # further than the poll
    clock.sleep(0.1)
    assert fake.waited == [pytest.approx(0.03), 0.1, 0.1, 0.1]
