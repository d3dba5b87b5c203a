"""Per-step collective counts: equal counts pass, a difference is a desync fault, a hung rank's
watchdog names the desync when a neighbour finished the step after fewer collectives."""

from __future__ import annotations

import threading

import pytest
import torch.distributed as dist

from resilient.runtime import fingerprint
from resilient.runtime.faults import FaultKind, classify
from resilient.runtime.fingerprint import CollectiveCount, CollectiveDesync


class _Seq:
    """Stands in for the process group's sequence number (one process plays every rank here)."""

    def __init__(self) -> None:
        self.value = 0


@pytest.fixture
def seq(monkeypatch: pytest.MonkeyPatch) -> _Seq:
    s = _Seq()
    monkeypatch.setattr(fingerprint, "_seq", lambda: s.value)
    return s


def _pair(store: dist.Store) -> tuple[CollectiveCount, CollectiveCount]:
    return CollectiveCount(store, "fp", 0, 2), CollectiveCount(store, "fp", 1, 2)


def test_equal_counts_pass_and_old_keys_are_deleted(seq: _Seq) -> None:
    store = dist.HashStore()
    a, b = _pair(store)
    for step in range(3):
        a.begin(step)
        b.begin(step)
        seq.value += 3  # both "issued" three collectives
        t = threading.Thread(target=b.check, args=(step,))
        t.start()
        a.check(step)
        t.join(5)
    assert not store.check(["fp/0/0"]) and store.check(["fp/2/0"])  # bounded: no key per step forever


def test_a_different_count_raises_desync_naming_both(seq: _Seq) -> None:
    store = dist.HashStore()
    a, _ = _pair(store)
    a.begin(7)
    seq.value = 2
    store.set("fp/7/1", "1")  # rank 1 finished step 7 after one collective
    with pytest.raises(CollectiveDesync, match=r"step 7: rank 0 issued 2 collectives, rank 1 issued 1"):
        a.check(7)
    assert classify(CollectiveDesync("x"))[0] is FaultKind.DESYNC


def test_hung_rank_diagnoses_desync_only_when_a_neighbour_did_fewer(seq: _Seq) -> None:
    store = dist.HashStore()
    a, _ = _pair(store)
    a.begin(4)
    seq.value = 2  # rank 0 has issued 2 collectives in step 4 and is blocked in the 2nd
    assert a.diagnose(store) is None  # the neighbour has not finished the step: just a hang
    store.set("fp/4/1", "2")
    assert a.diagnose(store) is None  # it did as many: rank 0 is slow, not desynchronized
    store.set("fp/4/1", "1")
    msg = a.diagnose(store)
    assert msg is not None and "rank 1 finished the step after 1 collectives, rank 0 has issued 2" in msg


def test_single_rank_never_waits(seq: _Seq) -> None:
    c = CollectiveCount(dist.HashStore(), "fp", 0, 1)
    c.begin(0)
    seq.value = 5
    c.check(0)
    assert c.diagnose(dist.HashStore()) is None
