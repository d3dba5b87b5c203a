"""A node's seat and lease in the rendezvous store, and a spare's watch of them, on a real TCPStore
and real sockets in this process: a member that ends well says goodbye, one killed closes its
socket, one that vanished stops beating; one spare claims a lost seat, and the lost node's agent,
if it comes back, finds itself fenced."""

from __future__ import annotations

import gc
import socket
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from resilient.events import Event
from resilient.launcher.elastic import RendezvousView
from resilient.launcher.seats import Keys, Lease, Seat, SeatHolder, store_endpoint
from resilient.launcher.spare import JobOver, Spare, StoreGone
from resilient.launcher.waiting import Membership
from tests._wait import wait_until


@pytest.fixture
def server() -> Any:
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=10), wait_for_workers=False)
    yield ("127.0.0.1", store.port)


def _seat(holder: SeatHolder | None, group_rank: int, size: int = 2, port: int = 0) -> Seat:
    return Seat(
        round=3,
        group_rank=group_rank,
        group_world_size=size,
        master_addr="127.0.0.1",
        master_port=29500,
        workers=((0, group_rank, group_rank, size, size),),
        host="127.0.0.1",
        port=holder.port if holder is not None else port,
    )


def _holder(where: tuple[str, int], gen: int = 5, me: str = "node") -> tuple[SeatHolder, list[str]]:
    fenced: list[str] = []
    return SeatHolder(where, "job", lambda: {0: (gen, 40)}, fenced.append, me), fenced


def test_the_rendezvous_store_is_found_for_c10d_only() -> None:
    assert store_endpoint("c10d", "10.0.0.1:29400") == ("10.0.0.1", 29400)
    assert store_endpoint("c10d", "head") == ("head", 29400)  # (torch's default port)
    assert store_endpoint("c10d", "[::1]:1234") == ("::1", 1234)
    assert store_endpoint("c10d", "localhost:0") is None  # --standalone: nothing can join
    assert store_endpoint("static", "10.0.0.1:29400") is None
    assert store_endpoint("c10d", None) is None


def test_seats_and_leases_round_trip() -> None:
    seat = _seat(None, 1, port=4242)
    assert Seat.loads(seat.dumps()) == seat
    lease = Lease(7, {3: (2, 40)}, bye=True)
    assert Lease.loads(lease.dumps()) == lease


def test_a_spare_takes_the_seat_of_a_member_whose_agent_died(server: tuple[str, int]) -> None:
    a, _ = _holder(server)
    b, _ = _holder(server, gen=6)
    a.hold(_seat(a, 0))
    b.hold(_seat(b, 1))
    events: list[tuple[Any, dict[str, Any]]] = []
    spare = Spare(server, "job", "spare-1", lambda e, **f: events.append((e, f)), lease_s=5.0)
    seats = spare.running()
    assert seats is not None and [s.group_rank for s in seats] == [0, 1]
    tends = []

    def tend() -> None:
        tends.append(1)
        if len(tends) == 3:  # the node is gone: its agent's sockets close without a goodbye
            b.close(bye=False)

    try:
        taken = spare.park(seats, tend)
    finally:
        a.close()
    assert taken is not None and taken.seat.group_rank == 1 and taken.how == "connection"
    assert taken.generation == 6  # the newest any rank was in: its survivors wait there
    assert taken.steps == {0: 40}
    (lost,) = [f for e, f in events if e == Event.NODE_LOST]
    assert lost["group_rank"] == 1 and lost["taken_by"] == "spare-1"
    # one spare per seat: a second one's claim of the same seat fails
    other = Spare(server, "job", "spare-2", lambda e, **f: None)
    assert not other._claim(taken.seat)


def test_a_member_that_vanished_is_seen_when_its_lease_stands_still(server: tuple[str, int]) -> None:
    a, _ = _holder(server)
    a.hold(_seat(a, 0))
    # group rank 1's machine is gone: no agent answers at its address, its lease never moves
    client = dist.TCPStore(*server, None, False, timeout=timedelta(seconds=10), wait_for_workers=False)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    client.set(Keys("job").seat(3, 1), _seat(None, 1, port=dead).dumps())
    client.set(Keys("job").lease(3, 1), Lease(9, {1: (4, 12)}).dumps())
    spare = Spare(server, "job", "spare-1", lambda e, **f: None, lease_s=0.5)
    seats = spare.running()
    assert seats is not None
    t0 = time.monotonic()
    try:
        taken = spare.park(seats, lambda: None)
    finally:
        a.close()
    assert taken is not None and taken.seat.group_rank == 1 and taken.how == "lease"
    assert time.monotonic() - t0 >= 0.5


def test_members_that_end_well_end_the_spare_and_no_seat_is_taken(server: tuple[str, int]) -> None:
    a, _ = _holder(server)
    b, _ = _holder(server)
    a.hold(_seat(a, 0))
    b.hold(_seat(b, 1))
    spare = Spare(server, "job", "spare-1", lambda e, **f: None, lease_s=5.0)
    seats = spare.running()
    assert seats is not None
    closer = threading.Timer(0.3, lambda: (a.close(), b.close()))
    closer.start()
    with pytest.raises(JobOver):
        spare.park(seats, lambda: None)
    closer.join()
    client = dist.TCPStore(*server, None, False, timeout=timedelta(seconds=10), wait_for_workers=False)
    assert not client.check([Keys("job").claim(3, 0)]) and not client.check([Keys("job").claim(3, 1)])


def test_an_agent_whose_seat_was_claimed_is_fenced_but_not_the_spare_holding_it(
    server: tuple[str, int],
) -> None:
    lost, fenced = _holder(server, me="node-b")
    taker, taker_fenced = _holder(server, me="spare-1")
    client = dist.TCPStore(*server, None, False, timeout=timedelta(seconds=10), wait_for_workers=False)
    client.set(Keys("job").claim(3, 1), "spare-1")
    try:
        lost.hold(_seat(lost, 1))  # it comes back after its seat was taken
        taker.hold(_seat(taker, 1))  # the spare that took it holds it under its own claim
        beats = taker._n
        wait_until(lambda: fenced and taker._n >= beats + 3, 10, "the lost agent fenced")
    finally:
        lost.close(bye=False)
        taker.close()
    assert fenced == ["spare-1"] and taker_fenced == []


def test_a_lost_member_whose_seat_a_spare_took_restarts_nothing() -> None:
    said: list[tuple[Any, dict[str, Any]]] = []
    taken: set[int] = set()
    spares = [1]
    m = Membership(
        lambda e, **f: said.append((e, f)),
        False,
        taken=taken.__contains__,
        spares=lambda: spares[0],
        grace_s=0.3,
    )
    m.round_started(RendezvousView(3, frozenset({"a", "b"}), frozenset(), False, {"a": 0, "b": 1}))
    gone = RendezvousView(3, frozenset({"a"}), frozenset(), False, {"a": 0})
    assert m.count(0, gone) == 0  # a spare parks: the seat may still be taken
    taken.add(1)
    assert m.count(0, gone) == 0 and m.count(0, gone) == 0
    assert [e for e, _ in said] == [Event.NODE_REPLACED]  # said once
    # without a spare, a lost member restarts the group once the grace is over (at once: none parks)
    m.round_started(RendezvousView(3, frozenset({"a", "b"}), frozenset(), False, {"a": 0, "b": 1}))
    taken.clear()
    spares[0] = 0
    assert m.count(0, gone) == 1
    assert said[-1][0] == Event.NODE_LOST


def test_a_lost_member_counts_once_the_spares_grace_is_over() -> None:
    now = [100.0]
    m = Membership(lambda e, **f: None, False, spares=lambda: 1, grace_s=0.2, clock=lambda: now[0])
    m.round_started(RendezvousView(3, frozenset({"a", "b"}), frozenset(), False, {"a": 0, "b": 1}))
    gone = RendezvousView(3, frozenset({"a"}), frozenset(), False, {"a": 0})
    assert m.count(0, gone) == 0
    now[0] += 0.25  # a spare's claim never came within the grace
    assert m.count(0, gone) == 1


def test_a_spare_whose_store_vanished_without_goodbyes_does_not_call_it_the_jobs_end() -> None:
    master = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=10), wait_for_workers=False)
    where = ("127.0.0.1", master.port)
    a, _ = _holder(where)
    a.hold(_seat(a, 0, size=1))
    spare = Spare(where, "job", "spare-1", lambda e, **f: None, lease_s=30.0)
    seats = spare.running()
    assert seats is not None
    stores = [master]
    del master

    def tend() -> None:
        if stores:  # the store's host goes (its node lost): the server closes
            stores.pop()
            gc.collect()

    try:
        with pytest.raises(StoreGone):
            spare.park(seats, tend)
    finally:
        a.close(bye=False)
