"""Collective counts per check window: equal counts pass, a difference is a desync fault (also when
it happened steps before the check), a hung rank's watchdog names the desync when a neighbour
closed the window after fewer collectives."""

from __future__ import annotations

import threading

import pytest
import torch.distributed as dist

from resilient.detectors import collectives as fingerprint
from resilient.detectors.collectives import CollectiveCount, CollectiveDesync
from resilient.runtime.faults.records import classify


class _Seq:
    """Stands in for the process group's sequence number (one process plays every rank here)."""

    def __init__(self) -> None:
        self.value = 0


@pytest.fixture
def seq(monkeypatch: pytest.MonkeyPatch) -> _Seq:
    s = _Seq()
    monkeypatch.setattr(fingerprint, "issued_on_default_group", lambda: s.value)
    return s


def _pair(store: dist.Store) -> tuple[CollectiveCount, CollectiveCount]:
    return CollectiveCount(store, "fp", 0, 2), CollectiveCount(store, "fp", 1, 2)


def _both_check(a: CollectiveCount, b: CollectiveCount, step: int) -> None:
    t = threading.Thread(target=b.check, args=(step,))
    t.start()
    a.check(step)
    t.join(5)


def test_equal_counts_pass_and_old_keys_are_deleted(seq: _Seq) -> None:
    store = dist.HashStore()
    a, b = _pair(store)
    for step in range(3):
        a.begin(step)
        b.begin(step)
        seq.value += 3  # both "issued" three collectives
        _both_check(a, b, step)
    assert not store.check(["fp/0/0"]) and store.check(["fp/2/0"])  # bounded: no key per check forever


def test_steps_between_checks_make_no_store_request(seq: _Seq) -> None:
    store = dist.HashStore()
    a = CollectiveCount(store, "fp", 0, 2)
    for step in range(5):
        a.begin(step)
        seq.value += 1
    assert store.num_keys() == 0
    store.set("fp/0/1", "5")  # rank 1 issued as many over the same five steps
    a.check(4)
    assert a.checks == 1


def test_a_different_count_raises_desync_naming_both(seq: _Seq) -> None:
    store = dist.HashStore()
    a, _ = _pair(store)
    a.begin(7)
    seq.value = 2
    store.set("fp/0/1", "1")  # rank 1 closed the same window after one collective
    with pytest.raises(CollectiveDesync, match=r"step 7: rank 0 issued 2 collectives, rank 1 issued 1"):
        a.check(7)
    assert classify(CollectiveDesync("x", window_end=0))[0] == "desync"


def test_a_skip_steps_before_the_check_is_still_caught(seq: _Seq) -> None:
    """A collective skipped at step 1 and none later: the window's total differs at step 3."""
    store = dist.HashStore()
    a = CollectiveCount(store, "fp", 0, 2)
    for step in range(1, 4):
        a.begin(step)
        seq.value += 1
    store.set("fp/0/1", "2")
    with pytest.raises(CollectiveDesync, match=r"steps 1-3: rank 0 issued 3 collectives, rank 1 issued 2"):
        a.check(3)


def test_hung_rank_diagnoses_desync_only_when_a_neighbour_did_fewer(seq: _Seq) -> None:
    store = dist.HashStore()
    a, _ = _pair(store)
    a.begin(4)
    seq.value = 2  # rank 0 has issued 2 collectives in the window and is blocked in the 2nd
    assert a.diagnose(store) is None  # the neighbour has not reached the check: just a hang
    store.set("fp/0/1", "2")
    assert a.diagnose(store) is None  # it did as many: rank 0 is slow, not desynchronized
    store.set("fp/0/1", "1")
    msg = a.diagnose(store)
    assert msg is not None and "rank 1 reached the next check after 1 collectives, rank 0 has issued 2" in msg


def test_single_rank_never_waits(seq: _Seq) -> None:
    c = CollectiveCount(dist.HashStore(), "fp", 0, 1)
    c.begin(0)
    seq.value = 5
    c.check(0)
    assert c.diagnose(dist.HashStore()) is None


def test_a_window_closes_without_waiting_and_is_settled_when_the_neighbour_posts(seq: _Seq) -> None:
    store = dist.HashStore()
    a = CollectiveCount(store, "fp", 0, 2)
    a.begin(3)
    seq.value = 4
    a.close_window(3)
    assert a.pending == 3 and store.get("fp/0/0") == b"4"
    assert a.settle(block=False) is False  # rank 1 has not closed the window yet: no wait
    store.set("fp/0/1", "4")
    assert a.settle(block=False) is True and a.pending is None


def test_a_deferred_difference_names_the_window_whose_state_must_go(seq: _Seq) -> None:
    store = dist.HashStore()
    a = CollectiveCount(store, "fp", 0, 2)
    a.begin(5)
    seq.value = 3
    a.close_window(6)
    store.set("fp/0/1", "2")
    with pytest.raises(CollectiveDesync) as ei:
        a.settle(block=False)
    assert ei.value.window_end == 6 and "steps 5-6" in str(ei.value)


def test_a_fast_rank_keeps_the_window_a_slow_predecessor_has_yet_to_compare(seq: _Seq) -> None:
    """Window 0 kept in the ring (compared lazily), window 1 a step later leaving the process
    (compared at once). Rank 2 compares window 1 with rank 0 before rank 1 has finished the step:
    its post of window 0, which rank 1 has not read yet, must still be there (else rank 1 waits
    for it until its watchdog calls a hang: a false alarm)."""
    store = dist.HashStore()
    r0, r1, r2 = (CollectiveCount(store, "fp", r, 3) for r in range(3))
    for c in (r0, r1, r2):
        c.begin(0)
    seq.value += 1
    for c in (r0, r1, r2):
        c.close_window(0)  # the ring's snapshot: posted, compared at the next step
    for c in (r0, r1, r2):
        c.begin(1)
    seq.value += 1  # step 1's all-reduce, completed on every rank
    r0.close_window(1)  # (compares window 0 with rank 1 first, then posts window 1)
    r2.close_window(1)
    assert r2.settle(block=True)  # rank 2 compared window 1 with rank 0's: it moves on
    assert r1.settle(block=False), "rank 2's count of window 0 is gone before rank 1 read it"
    r1.close_window(1)
    assert r1.settle(block=False) and r0.settle(block=False)


def test_what_one_rank_issues_uncounted_is_left_out_of_its_window(seq: _Seq) -> None:
    """A handover's transfer (a donor and its replacement only) must not read as a desync."""
    store = dist.HashStore()
    a = CollectiveCount(store, "fp", 0, 2)
    with a.uncounted():
        seq.value += 3  # rank 0 alone sent three tensors to a replacement
    b = CollectiveCount(store, "fp", 1, 2)  # (one counter plays both: rank 1's never saw those)
    a.begin(0)
    b.begin(0)
    seq.value += 2  # and both issued the step's two
    _both_check(a, b, 0)
    assert a.checks == b.checks == 1


def test_a_live_resume_carries_the_unverified_steps_into_the_next_generation_s_window(seq: _Seq) -> None:
    # a flipped bit at step 37 that no check saw before a NaN's live resume at step 50: the next
    # generation's digests differ at step 63, and the fault must say it may have begun at 37's
    # window (the replay check's reference ends there), not at 50
    from resilient.runtime.run.generation import PendingRestore
    from resilient.runtime.steps.loop import carry_unverified

    store = dist.HashStore()
    old = CollectiveCount(store, "g1", 0, 2)
    for step in range(37, 51):
        old.begin(step)
    for source, since in (("live", 37), ("peer", 37), ("ring", 50)):
        new = CollectiveCount(store, f"g2{source}", 0, 2)
        restore = PendingRestore(50, {}, True, 50, None, source=source)
        carry_unverified(old, new, restore)
        new.begin(50)
        assert new.window_start == since, source
