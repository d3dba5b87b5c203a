"""The monitor's decisions (driven by an injected clock) and the main-thread interrupt."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from resilient.config import Timeouts
from resilient.errors import StepInterrupted
from resilient.runtime.leave.watchdog import MainThreadInterrupter, Monitor

TIMEOUTS = Timeouts.derive(10.0, None)  # hang 10 s, startup 50 s


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class FakeRuntime:
    """The narrow `Watched` interface, recording what the monitor asked for."""

    def __init__(self, clock: Clock) -> None:
        self.generation: int | None = 0
        self.last = clock.now
        self.started = False
        self.fault: object | None = None
        self.calls: list[tuple[object, ...]] = []
        self.in_collective = False  # where the main thread is blocked
        self.hang_seen = threading.Event()

    def running_generation(self) -> int | None:
        return self.generation

    def last_progress(self) -> tuple[float, bool]:
        return self.last, self.started

    def remote_fault(self, generation: int) -> object | None:
        return self.fault

    def on_remote_fault(self, generation: int, fault: object) -> None:
        self.calls.append(("remote", generation, fault))

    def on_hang(self, generation: int, idle_s: float) -> None:
        self.calls.append(("hang", generation, idle_s))
        self.hang_seen.set()

    def nudge(self, generation: int) -> None:
        self.calls.append(("nudge", generation))

    def main_thread_where(self) -> tuple[str, bool]:
        return ("train.py:42 in step", self.in_collective)

    def kinds(self) -> list[object]:
        return [c[0] for c in self.calls]


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def rt(clock: Clock) -> FakeRuntime:
    return FakeRuntime(clock)


@pytest.fixture
def mon(rt: FakeRuntime, clock: Clock) -> Monitor:
    return Monitor(rt, TIMEOUTS, clock=clock)


def test_first_step_gets_the_startup_limit(rt, clock, mon):
    clock.now += TIMEOUTS.hang + 1  # past the hang limit, but the first step has not completed
    mon.poll()
    assert rt.calls == []
    clock.now = rt.last + TIMEOUTS.startup + 0.5
    mon.poll()
    assert rt.kinds() == ["hang"]
    assert rt.calls[0][1] == 0 and rt.calls[0][2] == pytest.approx(TIMEOUTS.startup + 0.5)


def test_hang_fires_once_after_the_hang_timeout_then_nudges(rt, clock, mon):
    rt.started = True
    clock.now += TIMEOUTS.hang - 0.01
    mon.poll()
    assert rt.calls == []
    clock.now += 0.02
    mon.poll()
    assert rt.kinds() == ["hang"]
    assert rt.calls[0][2] == pytest.approx(TIMEOUTS.hang + 0.01)
    for _ in range(3):
        clock.now += 100
        mon.poll()
    assert rt.kinds() == ["hang", "nudge", "nudge", "nudge"]
    assert all(c[1] == 0 for c in rt.calls)


def test_a_rank_blocked_in_a_collective_gives_the_culprit_a_grace_period(rt, clock, mon):
    rt.started = True
    rt.in_collective = True  # probably the victim of a peer that hangs elsewhere
    assert TIMEOUTS.victim_grace > 0
    clock.now += TIMEOUTS.hang + TIMEOUTS.victim_grace / 2
    mon.poll()
    assert rt.calls == []
    clock.now += TIMEOUTS.victim_grace
    mon.poll()
    assert rt.kinds() == ["hang"]


def test_the_culprits_fault_during_the_grace_period_wins(rt, clock, mon):
    rt.started = True
    rt.in_collective = True
    clock.now += TIMEOUTS.hang + TIMEOUTS.victim_grace / 2
    mon.poll()
    rt.fault = {"rank": 2, "kind": "hang"}  # the culprit posted its hang
    mon.poll()
    assert rt.calls == [("remote", 0, rt.fault)]


def test_progress_resets_the_idle_time(rt, clock, mon):
    rt.started = True
    for _ in range(5):
        clock.now += TIMEOUTS.hang * 0.9
        rt.last = clock.now  # a step completed
        mon.poll()
    assert rt.calls == []


def test_a_new_generation_is_watched_afresh(rt, clock, mon):
    rt.started = True
    clock.now += TIMEOUTS.hang + 1
    mon.poll()
    rt.generation, rt.last, rt.started = 1, clock.now, False  # recovered: generation 1 starts
    mon.poll()
    assert rt.kinds() == ["hang"]
    clock.now += TIMEOUTS.startup + 1
    mon.poll()
    assert rt.calls[-1][:2] == ("hang", 1)


def test_nothing_is_watched_between_generations(rt, clock, mon):
    rt.generation = None
    rt.fault = "fault"
    clock.now += 10 * TIMEOUTS.startup
    mon.poll()
    assert rt.calls == []


def test_remote_fault_wins_over_hang_and_is_handled_once(rt, clock, mon):
    rt.started = True
    rt.fault = {"rank": 1, "kind": "exception"}
    clock.now += TIMEOUTS.hang + 5  # a hang, too
    mon.poll()
    assert rt.calls == [("remote", 0, rt.fault)]
    mon.poll()
    mon.poll()
    assert rt.kinds() == ["remote", "nudge", "nudge"]
    rt.generation = 1  # the next generation's fault is handled again
    mon.poll()
    assert rt.calls[-1] == ("remote", 1, rt.fault)


def test_monitor_thread_survives_a_failing_poll_and_stops(clock):
    class Flaky(FakeRuntime):
        fails = 2

        def remote_fault(self, generation: int) -> object | None:
            if self.fails:
                self.fails -= 1
                raise RuntimeError("store connection reset")
            return None

    rt = Flaky(clock)
    rt.started = True
    clock.now += TIMEOUTS.hang + 1
    mon = Monitor(rt, Timeouts.derive(0.05, None), clock=clock)
    mon.start()
    try:
        assert rt.hang_seen.wait(5), "the monitor thread died on a failing poll"
    finally:
        mon.stop()
    assert not mon.is_alive()
    mon.stop()  # idempotent


# -- MainThreadInterrupter ------------------------------------------------------------------------


def test_interrupt_pulls_the_main_thread_out_of_a_blocking_call():
    assert threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGUSR2)
    intr = MainThreadInterrupter("SIGUSR2", is_current=lambda gen: gen == 3)
    timer = threading.Timer(0.2, intr.interrupt, args=(3, "hang: no progress for 10.0s"))
    intr.install()
    try:
        timer.start()
        t0 = time.monotonic()
        with pytest.raises(StepInterrupted) as ei:
            time.sleep(30)  # the hang under test
        assert time.monotonic() - t0 < 2.0
        assert ei.value.reason == "hang: no progress for 10.0s"
        assert not intr.still_pending(3)
    finally:
        timer.cancel()
        intr.uninstall()
    assert signal.getsignal(signal.SIGUSR2) == previous


def test_a_stale_interrupt_is_ignored():
    intr = MainThreadInterrupter("SIGUSR2", is_current=lambda gen: False)  # generation already over
    timer = threading.Timer(0.1, intr.interrupt, args=(2, "peer: rank 1 faulted"))
    intr.install()
    try:
        timer.start()
        t0 = time.monotonic()
        time.sleep(0.5)  # must complete normally despite the signal
        elapsed = time.monotonic() - t0
        timer.join(2)
    finally:
        timer.cancel()
        intr.uninstall()
    assert elapsed >= 0.5
    assert intr.still_pending(2) and not intr.still_pending(3)


def test_install_outside_the_main_thread_is_refused():
    intr = MainThreadInterrupter("SIGUSR2", is_current=lambda gen: True)
    errors: list[BaseException] = []

    def target() -> None:
        try:
            intr.install()
        except BaseException as e:
            errors.append(e)

    th = threading.Thread(target=target)
    th.start()
    th.join(5)
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError)
    assert "main thread" in str(errors[0])
    intr.uninstall()  # never installed: a no-op


def test_step_interrupted_is_not_swallowed_by_except_exception():
    with pytest.raises(StepInterrupted):
        try:
            raise StepInterrupted("hang: x")
        except Exception:  # what user code around its step typically does
            pytest.fail("StepInterrupted was caught by `except Exception`")


def test_monitor_sleeps_until_the_hang_deadline_not_on_a_fixed_poll(rt, clock, mon):
    rt.started = True
    # far from the deadline: a long sleep (peer_report at most: a step check's long wait is said)
    assert mon.poll() == pytest.approx(min(TIMEOUTS.hang / 4, TIMEOUTS.peer_report))
    clock.now += TIMEOUTS.hang - 0.3
    assert mon.poll() == pytest.approx(max(TIMEOUTS.monitor_interval, 0.3))  # wakes at the deadline
    clock.now += 0.31
    mon.poll()
    assert rt.kinds() == ["hang"]


def test_fault_listener_reports_a_posted_fault_and_releases_on_close():
    import torch.distributed as dist

    from resilient.runtime.coordination.coordinator import Coordinator
    from resilient.runtime.faults.records import FaultRecord
    from resilient.runtime.leave.watchdog import FaultListener

    store = dist.HashStore()
    coord0, coord1 = (Coordinator(store, "ns", r, 2, 2.0) for r in (0, 1))
    heard: list[tuple[int, object]] = []
    got = threading.Event()

    def on_fault(gen: int, fault: object) -> None:
        heard.append((gen, fault))
        got.set()

    listener = FaultListener(lambda g: coord0.wait_fault(g, store), on_fault)
    listener.start()
    try:
        listener.watch(0)
        coord1.post_fault(FaultRecord(1, 0, 5, "exception", "soft", "exception: E: x", "E: x"))
        assert got.wait(5), "the listener did not wake on the posted fault"
        assert heard[0][0] == 0 and heard[0][1].rank == 1  # type: ignore[attr-defined]
        # generation 1 finishes cleanly: the closing sentinel wakes the listener without a report
        listener.watch(1)
        coord0.close_generation(1)
        assert coord0.primary_fault(1) is None
    finally:
        listener.stop()
        listener.join(5)
    assert not listener.is_alive()
    assert len(heard) == 1


def test_a_step_checks_long_wait_for_a_peer_is_said_once_with_what_holds_it_up(rt, clock, mon):
    from resilient.detectors.collectives import PeerWait

    rt.started = True
    wait = PeerWait("ns/g0/fp/3/1", 1, since=clock.now)
    rt.peer_wait = lambda: wait  # (the optional part of Watched)
    said: list[PeerWait] = []
    rt.on_peer_wait = lambda gen, w: said.append(w)
    mon.poll()
    assert not said  # within the bound: nothing to say yet
    clock.now += TIMEOUTS.peer_report
    wait.request_since = clock.now - 0.9 * TIMEOUTS.peer_report  # a request in flight that long
    mon.poll()
    mon.poll()
    assert said == [wait] and wait.reported  # said once
    assert wait.cause(clock.now, TIMEOUTS.peer_report) == "store"
    assert "its store request in flight" in wait.describe(clock.now, TIMEOUTS.peer_report)
    wait.request_since, wait.reads = None, 12
    assert wait.cause(clock.now, TIMEOUTS.peer_report) == "peer"
    assert "rank 1 has not posted it (12 reads" in wait.describe(clock.now, TIMEOUTS.peer_report)


def test_a_count_read_that_blocks_in_the_store_shows_as_in_flight() -> None:
    # a store whose server stalls (a request that does not return): the wait record says a
    # request is in flight, so the monitor can tell a stalled store from a peer that is behind
    import torch.distributed as dist

    from resilient.detectors.collectives import CollectiveCount

    release = threading.Event()

    class Stalling(dist.HashStore):  # type: ignore[misc]
        def compare_set(self, key, expected, desired):  # type: ignore[no-untyped-def]
            release.wait(10)
            return super().compare_set(key, expected, desired)

    store = Stalling()
    count = CollectiveCount(store, "p", 0, 2)
    ended: list[float] = []
    count.on_wait_end = lambda w, s: ended.append(s)
    t = threading.Thread(target=count._await, args=("p/0/1", 1))
    t.start()
    try:
        deadline = time.monotonic() + 10
        while (count.wait is None or count.wait.request_since is None) and time.monotonic() < deadline:
            time.sleep(0.005)  # (another thread's progress, polled with a bound)
        w = count.wait
        assert w is not None and w.request_since is not None and w.reads == 0
        w.reported = True  # as the monitor would have
        store.set("p/0/1", "1")
    finally:
        release.set()
        t.join(10)
    assert count.wait is None and len(ended) == 1 and ended[0] > 0
