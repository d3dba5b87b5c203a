"""Point-to-point ops counted apart from collectives, per peer and direction (detectors/p2p.py):
a pipeline's stages, which send different numbers of tensors, are no desync; a stage that skips a
send is one, naming both ranks, at the check or, when it blocks its peers, at the hang."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from resilient.detectors import collectives as fingerprint
from resilient.detectors import p2p
from resilient.detectors.collectives import CollectiveCount, CollectiveDesync


@pytest.fixture
def fake_group() -> Iterator[None]:
    """A 4-rank group of torch's ``fake`` backend (its ops return at once), this process rank 0."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    p2p.install()
    try:
        yield
    finally:
        p2p.uninstall()
        dist.destroy_process_group()


def test_every_way_of_sending_is_counted_by_global_peer(
    fake_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    tally = p2p.Tally()
    monkeypatch.setattr(p2p, "TALLY", tally)
    t, r = torch.ones(2), torch.zeros(2)
    ops = [
        dist.P2POp(dist.isend, t, 1),
        dist.P2POp(dist.irecv, r, 1),
    ]  # (P2POp takes the functions as they are)
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    dist.send(t, 3)
    sub = dist.new_group([0, 2])  # a mesh dimension's group: its rank 1 is rank 2 of the job
    dist.isend(t, group=sub, group_dst=1).wait()
    dist.recv(r, group=sub, group_src=1)
    dist.all_reduce(t)  # a collective: not point to point
    assert tally.ops == {">1": 1, "<1": 1, ">3": 1, ">2": 1, "<2": 1}


def test_uninstall_puts_the_methods_back_once_every_user_is_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    # (counted from none: a run of another test in this process may still hold the wrappers)
    monkeypatch.setattr(p2p, "_users", 0)
    monkeypatch.setattr(p2p, "_installed", [])
    original = dist.ProcessGroup.send
    p2p.install()
    p2p.install()
    p2p.uninstall()
    assert dist.ProcessGroup.send is not original
    p2p.uninstall()
    assert dist.ProcessGroup.send is original


def test_sequence_numbers_taken_are_the_default_groups_while_it_lives() -> None:
    class Group:
        pass

    tally, g1, g2 = p2p.Tally(), Group(), Group()
    tally.took(g1, 3)
    tally.took(g1, 2)
    assert tally.taken(g1) == 5 and tally.taken(g2) == 0
    tally.took(g2, 1)  # the next generation's group: counted afresh
    assert tally.taken(g2) == 1 and tally.taken(g1) == 0


# -- in the collective count's posts -----------------------------------------------------------------
@pytest.fixture
def seq(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    value = [0]
    monkeypatch.setattr(fingerprint, "issued_on_default_group", lambda: value[0])
    return value


def _chain(store: dist.Store, world: int) -> list[tuple[CollectiveCount, p2p.Tally]]:
    out = []
    for r in range(world):
        tally = p2p.Tally()
        out.append((CollectiveCount(store, "fp", r, world, tally=tally), tally))
    return out


def _pipeline_step(
    ranks: list[tuple[CollectiveCount, p2p.Tally]], microbatches: int, skip: tuple[int, int] | None = None
) -> None:
    """Each stage sends each microbatch's activations on and its gradients back."""
    for i in range(len(ranks) - 1):
        for mb in range(microbatches):
            if skip != (i, mb):
                ranks[i][1].count(p2p.SENT, i + 1)
            ranks[i + 1][1].count(p2p.RECEIVED, i)
            ranks[i + 1][1].count(p2p.SENT, i)
            ranks[i][1].count(p2p.RECEIVED, i + 1)


def _all_check(ranks: list[tuple[CollectiveCount, p2p.Tally]], step: int) -> list[BaseException]:
    errors: list[BaseException] = []

    def run(c: CollectiveCount) -> None:
        try:
            c.check(step)
        except CollectiveDesync as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(c,)) for c, _ in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    return errors


def test_stages_that_send_different_amounts_are_no_desync(seq: list[int]) -> None:
    """Four stages: the middle ones send and receive twice what the ends do (gloo counted it all
    as collectives: a false desync at the first check)."""
    ranks = _chain(dist.HashStore(), 4)
    for step in range(3):
        for c, _ in ranks:
            c.begin(step)
        _pipeline_step(ranks, 4)
        assert _all_check(ranks, step) == []
    assert ranks[0][0].peers == {1} and ranks[1][0].peers == {0, 2}


def test_a_skipped_send_is_a_desync_naming_both_ranks(seq: list[int]) -> None:
    store = dist.HashStore()
    ranks = _chain(store, 3)
    for c, _ in ranks:
        c.begin(5)
    _pipeline_step(ranks, 4, skip=(1, 2))  # rank 1 does not send microbatch 2's activations
    errors = _all_check(ranks, 5)
    assert errors and all(
        "rank 1 sent 3 tensors to rank 2, which received 4 from it" in str(e) for e in errors
    )
    assert all(isinstance(e, CollectiveDesync) and e.window_end == 5 for e in errors)


def test_a_peer_that_is_not_the_ring_neighbour_is_read_too(seq: list[int]) -> None:
    """A 2 x 2 mesh (pp x dp): stage pairs are ranks 0-2 and 1-3, not ring neighbours."""
    store = dist.HashStore()
    ranks = _chain(store, 4)
    for c, _ in ranks:
        c.begin(0)
    for a, b in ((0, 2), (1, 3)):
        ranks[a][1].count(p2p.SENT, b, 4)
        ranks[b][1].count(p2p.RECEIVED, a, 3 if a == 1 else 4)  # rank 3 got one fewer from rank 1
        ranks[b][1].count(p2p.SENT, a, 4)
        ranks[a][1].count(p2p.RECEIVED, b, 4)
    errors = _all_check(ranks, 0)
    assert {str(e).split(": ", 1)[1] for e in errors} == {
        "rank 1 sent 4 tensors to rank 3, which received 3 from it; state not kept"
    }


def test_a_handovers_transfer_is_left_out(seq: list[int]) -> None:
    store = dist.HashStore()
    (a, ta), (b, _) = _chain(store, 2)
    a.begin(0)
    b.begin(0)
    with a.uncounted():
        ta.count(p2p.SENT, 1, 7)  # the donor's transfer to a replacement, which receives it uncounted
    assert _all_check([(a, ta), (b, p2p.Tally())], 0) == [] and a.peers == set()


# -- at a hang ------------------------------------------------------------------------------------------
def _hung(store: dist.Store, world: int) -> list[tuple[CollectiveCount, p2p.Tally]]:
    ranks = _chain(store, world)
    for c, _ in ranks:
        c.begin(12)
    return ranks


def test_a_mutual_wait_of_two_blocked_stages_is_a_deadlock(seq: list[int]) -> None:
    """Stage 0 skipped microbatch 1's send: stage 1 waits for a 4th activation, stage 0 for a
    4th gradient. Both blocked, each diagnosing: the second to look names both."""
    store = dist.HashStore()
    (c0, t0), (c1, t1) = _hung(store, 2)
    t0.count(p2p.SENT, 1, 3)
    t0.count(p2p.RECEIVED, 1, 4)
    t1.count(p2p.RECEIVED, 0, 4)
    t1.count(p2p.SENT, 0, 3)
    assert c0.diagnose(store, blocked=True, wait_s=0.0) is None  # rank 1 has not posted yet
    msg = c1.diagnose(store, blocked=True, wait_s=0.0)
    assert msg is not None and "ranks 1 and 0 wait for each other" in msg
    assert "rank 1 posted 4 receives from rank 0, which sent 3" in msg


def test_a_blocked_rank_waits_a_moment_for_its_peers_post() -> None:
    now = [0.0]
    posts: dict[int, tuple[bool, dict[str, int], bool]] = {}

    def sleep(s: float) -> None:
        now[0] += s
        if now[0] > 0.05:  # the peer's own diagnosis posts a moment later
            posts[1] = (False, {"<0": 4, ">0": 3}, True)

    msg = p2p.diagnose_hang(
        0, {">1": 3, "<1": 4}, [1], "step 3", posts.get, blocked=True, wait_s=1.0,
        clock=lambda: now[0], sleep=sleep,
    )  # fmt: skip
    assert msg is not None and "wait for each other" in msg and now[0] < 0.2


def test_a_victim_of_a_peer_hung_in_its_own_code_is_no_desync(seq: list[int]) -> None:
    """Stage 1 hangs in a forward (not blocked on a peer): stage 0 waits for its gradient."""
    store = dist.HashStore()
    (c0, t0), (c1, t1) = _hung(store, 2)
    t0.count(p2p.SENT, 1, 2)
    t0.count(p2p.RECEIVED, 1, 1)
    t1.count(p2p.RECEIVED, 0, 2)
    assert c1.diagnose(store, blocked=False) is None
    assert c0.diagnose(store, blocked=True, wait_s=0.0) is None


def test_a_peer_that_reached_the_check_having_sent_too_few_is_named(seq: list[int]) -> None:
    store = dist.HashStore()
    (c0, t0), (c1, t1) = _hung(store, 2)
    t0.count(p2p.SENT, 1, 3)
    c0.close_window(12)  # rank 0 went on to the check after 3 sends
    t1.count(p2p.RECEIVED, 0, 4)
    msg = c1.diagnose(store)
    assert msg is not None and "rank 0 reached the next check after sending 3 tensors to rank 1" in msg


def test_old_posts_go_without_a_collective_once_their_readers_moved_on(seq: list[int]) -> None:
    """A pipeline alone: no collective in any window (the count's proof that every reader moved
    on had been one), yet the posts of windows its readers closed are deleted."""
    store = dist.HashStore()
    ranks = _chain(store, 3)
    for step in range(4):
        for c, _ in ranks:
            c.begin(step)
        _pipeline_step(ranks, 2)
        assert _all_check(ranks, step) == []
    assert not any(store.check([f"fp/0/{r}"]) for r in range(3)) and store.check(["fp/3/0"])


def test_after_an_abort_no_op_is_posted_until_the_next_group(fake_group: None) -> None:
    """One posted while the aborted group's connections are shut can miss the shutdown: refused."""
    from resilient.errors import StepInterrupted

    t = torch.ones(2)
    p2p.refuse("generation 3's group was aborted")
    try:
        with pytest.raises(StepInterrupted, match="not posted: generation 3's group was aborted"):
            dist.isend(t, 1)
    finally:
        p2p.accept()
    dist.isend(t, 1).wait()
