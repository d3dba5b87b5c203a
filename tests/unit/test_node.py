"""Node aggregation: a node's ranks meet on their node's store (real loopback TCPStores here) and
reach the job's store as one; a mixed job (some ranks alone) agrees the same; a leader that dies
(a real process, SIGKILLed) leaves its node's ranks on the job's store, with the loss reported."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from resilient.detectors import collectives as fingerprint
from resilient.detectors.collectives import CollectiveCount, CollectiveDesync
from resilient.errors import PeerAborted
from resilient.runtime.coordination import node as node_mod
from resilient.runtime.coordination.agreement import RestorePlan
from resilient.runtime.coordination.coordinator import Coordinator
from tests.unit.test_coordinator import NS, Concurrently, Counting, record

LOCAL = 2  # ranks per node
WORLD = 4  # two nodes


def _link(job: dist.Store, rank: int) -> node_mod.NodeLink:
    # (connects get a generous limit: about 1 in 25 TCPStore connects stalls 5 s on this machine)
    got = node_mod.link(job, f"{NS}/node/{rank - rank % LOCAL}", rank, rank % LOCAL, LOCAL, 30.0, 60.0)
    assert isinstance(got, node_mod.NodeLink), got
    return got


@pytest.fixture
def job() -> dist.Store:
    return dist.HashStore()


def linked(job: dist.Store, *, flat_nodes: tuple[int, ...] = (), timeout: float = 5.0) -> list[Coordinator]:
    """One coordinator per rank of two nodes, each with its own counting view of the job's store;
    ranks of ``flat_nodes`` have no link (as after a leader's loss)."""
    links: list[Any] = [None] * WORLD
    joining = [r for r in range(WORLD) if r // LOCAL not in flat_nodes]
    run = Concurrently(*[lambda r=r: links.__setitem__(r, _link(job, r)) for r in joining]).join(60)
    assert run.errors == [None] * len(joining), run.errors
    return [
        Coordinator(Counting(job), NS, r, WORLD, timeout, blocks=True, node=links[r])  # type: ignore[arg-type]
        for r in range(WORLD)
    ]


def job_requests(c: Coordinator) -> int:
    return sum(c.store.calls.values())  # type: ignore[attr-defined]


def test_node_mode_is_on_when_the_job_spans_nodes() -> None:
    assert node_mod.node_mode("auto", 16, 8) == (True, True)
    assert node_mod.node_mode("auto", 8, 8) == (False, False)  # one node: nothing to aggregate
    assert node_mod.node_mode("auto", 4, 1) == (True, False)  # one rank per node: blocks, no link
    assert node_mod.node_mode("on", 8, 8) == (True, True)
    assert node_mod.node_mode("off", 16, 8) == (False, False)


def test_a_barrier_reaches_the_job_store_once_per_node(job: dist.Store) -> None:
    c = linked(job)
    steps = [[12, 11], [12, 11], [12, 10], [11, 12]]
    run = Concurrently.each(c, lambda co: co.recovery_barrier(0, steps[co.rank])).join()
    assert run.errors == [None] * WORLD
    assert run.results == [RestorePlan(step=12, empty=[])] * WORLD
    # one rank per node (its last to arrive) carried the node's block; the others asked nothing
    talked = [co.rank for co in c if job_requests(co)]
    assert len(talked) == 2 and {r // LOCAL for r in talked} == {0, 1}, talked
    assert sorted(k.rsplit("/", 1)[-1] for k in _keys(job, f"{NS}/g0/recover/b/", ["0", "2"])) == ["0", "2"]


def _keys(store: dist.Store, prefix: str, tails: list[str]) -> list[str]:
    return [prefix + t for t in tails if store.check([prefix + t])]


@pytest.mark.parametrize("flat_nodes", [(), (1,), (0, 1)], ids=["linked", "mixed", "flat-blocks"])
def test_every_barrier_agrees_as_the_flat_one_does(job: dist.Store, flat_nodes: tuple[int, ...]) -> None:
    c = linked(job, flat_nodes=flat_nodes)
    run = Concurrently.each(c, lambda co: co.exchange(0, "ex", f"r{co.rank}")).join()
    assert run.results == [["r0", "r1", "r2", "r3"]] * WORLD, run.errors
    for how, votes, want in (("any", "0010", "1"), ("all", "1101", "0"), ("first", "abcd", "a")):
        run = Concurrently.each(c, lambda co, v=votes, h=how: co.agree(0, f"v{h}", v[co.rank], h)).join()
        assert run.results == [want] * WORLD, (how, run.errors)
    run = Concurrently.each(c, lambda co: co.same("layout", "d1" if co.rank != 3 else "d2", 5.0)).join()
    assert run.results == [False] * WORLD, run.errors
    run = Concurrently.each(c, lambda co: co.finish_barrier(0)).join()
    assert run.results == [True] * WORLD, run.errors


def test_a_fault_reaches_every_listener_through_its_node(job: dist.Store) -> None:
    c = linked(job)
    listeners = [co.store for co in c]  # (each rank's listener connection to the job's store)
    heard = Concurrently.each(c, lambda co: co.wait_fault(0, listeners[co.rank]))
    for co in c:
        co.store.calls.clear()  # type: ignore[attr-defined]
    primary = c[3].post_fault(record(3))
    heard.join()
    assert [f.rank for f in heard.results] == [3] * WORLD, heard.errors
    assert primary.rank == 3
    # a peer interrupted by it posts its own account to its node only, and is told the primary
    assert c[1].post_fault(record(1), known=primary) is primary
    assert job_requests(c[1]) == 0
    assert [o["rank"] for o in c[1].observations(0)] == [1, 3]


def test_ranks_that_returned_are_woken_when_a_node_peer_faults(job: dist.Store) -> None:
    c = linked(job)
    done = Concurrently(*[lambda co=co: co.finish_barrier(0) for co in c if co.rank != 1])
    c[1].post_fault(record(1))
    done.join()
    assert done.results == [False] * 3, done.errors


def test_an_abort_releases_the_nodes_waiting_ranks(job: dist.Store) -> None:
    c = linked(job)
    run = Concurrently(*[lambda co=co: co.recovery_barrier(1, [5]) for co in c[:3]])
    c[3].abort_generation(1, "health check 'gpu' failed")
    run.join()
    for e in run.errors:
        assert isinstance(e, PeerAborted) and "rank 3: health check 'gpu' failed" in str(e), e


# -- the collective check through nodes -----------------------------------------------------------
@pytest.fixture
def seq(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    value = [0]
    monkeypatch.setattr(fingerprint, "issued_on_default_group", lambda: value[0])
    yield value


def test_the_collective_check_posts_to_the_job_store_once_per_node(job: dist.Store, seq: list[int]) -> None:
    c = linked(job)
    fps = [CollectiveCount(co.store, "fp", co.rank, WORLD, co) for co in c]
    for fp in fps:
        fp.begin(0)
    seq[0] = 3  # every rank issued three collectives
    run = Concurrently(*[lambda fp=fp: fp.check(0) for fp in fps]).join()
    assert run.errors == [None] * WORLD
    # only the nodes' first ranks posted where the previous node's last rank reads
    assert _keys(job, "fp/0/", ["0", "1", "2", "3"]) == ["fp/0/0", "fp/0/2"]


def test_a_desync_is_caught_across_and_within_nodes(job: dist.Store, seq: list[int]) -> None:
    c = linked(job)
    last_of_node0, first_of_node0 = (
        CollectiveCount(c[1].store, "fp", 1, WORLD, c[1]),
        CollectiveCount(c[0].store, "fp", 0, WORLD, c[0]),
    )
    seq[0] = 2
    last_of_node0.begin(7)
    job.set("fp/0/2", "1")  # the next node's first rank closed the window after one collective
    with pytest.raises(CollectiveDesync, match="rank 1 issued 2 collectives, rank 2 issued 1"):
        last_of_node0.check(7)
    first_of_node0.begin(7)
    assert c[0].node is not None
    c[0].node.store.set("fp/0/1", "1")  # its neighbour on the same node, on the node's store
    with pytest.raises(CollectiveDesync, match="rank 0 issued 2 collectives, rank 1 issued 1"):
        first_of_node0.check(7)


# -- a leader that dies ---------------------------------------------------------------------------
LEADER = textwrap.dedent(
    """
    import signal, sys
    from datetime import timedelta
    import torch.distributed as dist
    from resilient.runtime.coordination import node
    job = dist.TCPStore("127.0.0.1", int(sys.argv[1]), None, False, timeout=timedelta(seconds=30))
    got = node.link(job, sys.argv[2], 0, 0, 2, 30.0, 60.0)
    assert isinstance(got, node.NodeLink), got
    print("linked", flush=True)
    signal.pause()  # (serves its node's store until the test kills it)
    """
)


@pytest.fixture
def tcp_job() -> Iterator[dist.TCPStore]:
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    yield store


def test_a_dead_leader_leaves_its_node_on_the_job_store_reported_once(tcp_job: dist.TCPStore) -> None:
    key = f"{NS}/node/0"
    leader = subprocess.Popen(
        [sys.executable, "-c", LEADER, str(tcp_job.port), key], stdout=subprocess.PIPE, text=True
    )
    try:
        assert leader.stdout is not None and leader.stdout.readline().strip() == "linked"
        got = node_mod.link(tcp_job, key, 1, 1, 2, 30.0, 60.0)
        assert isinstance(got, node_mod.NodeLink) and not got.leader
        lost: list[str] = []
        noticed = threading.Event()
        co = Coordinator(
            tcp_job,
            NS,
            1,
            2,
            5.0,
            blocks=True,
            node=got,
            on_lost=lambda why: (lost.append(why), noticed.set()),
        )
        listener = dist.TCPStore("127.0.0.1", tcp_job.port, None, False, timeout=timedelta(seconds=60))
        heard = Concurrently(lambda: co.wait_fault(0, listener))
        os.kill(leader.pid, signal.SIGKILL)
        leader.wait(10)
        assert noticed.wait(10), "the listener did not notice its node's store was gone"
        # the launcher's agent posts the dead worker's record on the job's store
        Coordinator(tcp_job, NS, 0, 2, 5.0).post_fault(record(0))
        heard.join(15)
        assert heard.errors == [None], heard.errors
        assert heard.results[0].rank == 0
        assert co.node is None and len(lost) == 1 and "DistNetworkError" in lost[0], lost
        # what it posts now goes to the job's store
        co.close_generation(1)
        assert tcp_job.get(f"{NS}/g1/fault") == b"__closed__"
    finally:
        leader.kill()
        leader.wait()


def test_a_replaced_leader_stays_on_the_job_store(job: dist.Store) -> None:
    first = _link(job, 0)
    again = node_mod.link(job, f"{NS}/node/0", 0, 0, LOCAL, 30.0, 60.0)
    assert isinstance(again, str) and "replaces it" in again
    assert first.leader
