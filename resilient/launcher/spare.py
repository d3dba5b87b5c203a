"""A spare node: one that arrives while a round runs parks, warm, and takes a lost node's seat.

torchrun admits a node that arrives late by restarting every worker at once; ``resilient launch``
keeps it waiting. A waiting node on a c10d rendezvous is a spare of the running round: its agent
starts its parked standbys (the script imported and run up to its ``resilient.wrap``, as warm as
a survivor) and watches every member's lease (:mod:`resilient.launcher.seats`): a socket to each
member's agent and the lease record each rewrites. When a member is lost — its socket closed
without a goodbye, or its lease still for ``lease_s`` — the spare claims its seat
(compare-and-set: one spare per seat, and the lost node's agent, if it comes back, finds itself
fenced), posts each lost rank's death to the workers' store as a fault of the generation they
were in (their survivors' listeners wake; they recover in their own processes), and the agent
starts the seat's ranks from its standbys with that generation to join: a lost node is replaced
as a lost rank is, the survivors' processes kept.

It stops parking when the round ends without it (the members restart their group: it then joins
the next round in torch's rendezvous, as a spare always did) or when every member said goodbye
(the job is over).
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from loguru import logger

from resilient.contract import death_record, publish_fault, run_namespace
from resilient.events import Event
from resilient.launch_env import Var
from resilient.launcher.seats import BEAT_S, BYE, Keys, Lease, Seat, connect

LEASE_S = 1.5  # a member whose lease did not move in this long is lost (its socket may say so first)


@dataclass(frozen=True)
class Taken:
    """A seat this spare claimed: the lost node's, and the generation its ranks join."""

    seat: Seat
    generation: int
    steps: dict[int, int]  # global rank -> the step its last heartbeat said
    how: str  # connection | lease


class JobOver(Exception):
    """Every member said goodbye while this spare parked: nothing to take."""


class StoreGone(JobOver):
    """The rendezvous store went while this spare parked, without the members' goodbyes: its host
    was lost (or the job ended badly). Not the job's success: the members' exit codes say."""


class _Watched:
    """One member as the spare sees it: its liveness socket and its lease's last beat."""

    def __init__(self, seat: Seat) -> None:
        self.seat = seat
        self.sock: socket.socket | None = None
        self.n = -1
        self.moved = time.monotonic()
        self.lease: Lease | None = None
        self.bye = False
        self.closed = False  # its socket closed without a goodbye
        with contextlib.suppress(OSError):
            self.sock = socket.create_connection((seat.host, seat.port), timeout=2)

    def read(self) -> None:
        """Its socket is readable: a goodbye, or closed."""
        assert self.sock is not None
        try:
            data = self.sock.recv(64)
        except OSError:
            data = b""
        if data.startswith(BYE):
            self.bye = True
        elif not data:
            self.closed = not self.bye
        if self.bye or not data:
            self.sock.close()
            self.sock = None

    def saw(self, lease: Lease | None, now: float) -> None:
        if lease is None:
            return
        if lease.n != self.n:
            self.n, self.moved, self.lease = lease.n, now, lease
        self.bye = self.bye or lease.bye


class Spare:
    """The spare's watch (its agent's main thread parks in :meth:`park`)."""

    def __init__(
        self,
        where: tuple[str, int],
        rdzv_id: str,
        me: str,
        emit: Callable[..., None],
        lease_s: float = LEASE_S,
    ) -> None:
        self.where = where
        self.keys = Keys(rdzv_id)
        self.run_id = rdzv_id
        self.me = me
        self.emit = emit
        self.lease_s = lease_s
        self.store = connect(where)

    def running(self) -> list[Seat] | None:
        """The running round's seats, when a round runs with every seat published; else None
        (the job starts: join torch's rendezvous)."""
        k = self.keys
        if not self.store.check([k.round()]):
            return None
        round_no = int(self.store.get(k.round()))
        first = k.seat(round_no, 0)
        if not self.store.check([first]):
            return None
        size = Seat.loads(self.store.get(first)).group_world_size
        names = [k.seat(round_no, g) for g in range(size)]
        if not self.store.check(names):
            return None
        return [Seat.loads(raw) for raw in self.store.multi_get(names)]

    def arrive(self) -> int:
        """This node's place among the nodes that came before any round ran (1: the first)."""
        return int(self.store.add(self.keys.arrived(), 1))

    def park(self, seats: list[Seat], tend: Callable[[], None]) -> Taken | None:
        """Watch ``seats`` until one is lost (claimed: returned), the round ends without this
        spare (None) or the job ends (:class:`JobOver`). ``tend()`` runs between looks (the
        standbys kept)."""
        watched = [_Watched(s) for s in seats]
        self.store.add(self.keys.spares(), 1)
        try:
            while True:
                tend()
                self._listen(watched, BEAT_S)
                try:
                    got = self._look(watched, seats[0].round)
                except JobOver:
                    raise
                except Exception as e:  # (the store's host ended without goodbyes, or was lost)
                    raise StoreGone(f"the rendezvous store is gone ({e})") from e
                if got is None or isinstance(got, Taken):
                    return got
        finally:
            with contextlib.suppress(Exception):
                self.store.add(self.keys.spares(), -1)
            for w in watched:
                if w.sock is not None:
                    w.sock.close()

    def _look(self, watched: list[_Watched], round_no: int) -> Taken | bool | None:
        """One look at the members: a seat taken, None (the round ended), False (nothing yet)."""
        self._read_leases(watched)
        if all(w.bye for w in watched):
            raise JobOver(f"every member of round {round_no} ended")
        if int(self.store.get(self.keys.round())) != round_no:
            return None
        for w in watched:
            how = self._lost(w)
            if how is not None and self._claim(w.seat):
                return self._taken(w, watched, how)
        return False

    def _listen(self, watched: list[_Watched], timeout_s: float) -> None:
        socks = [w.sock for w in watched if w.sock is not None]
        if not socks:
            time.sleep(timeout_s)  # (no socket to any member: their leases alone say)
            return
        ready, _, _ = select.select(socks, [], [], timeout_s)
        for w in watched:
            if w.sock is not None and w.sock in ready:
                w.read()

    def _read_leases(self, watched: list[_Watched]) -> None:
        names = [self.keys.lease(w.seat.round, w.seat.group_rank) for w in watched]
        now = time.monotonic()
        raws = self.store.multi_get(names) if self.store.check(names) else [None] * len(names)
        for w, raw in zip(watched, raws, strict=True):
            w.saw(Lease.loads(raw) if raw else None, now)

    def _lost(self, w: _Watched) -> str | None:
        if w.bye:
            return None
        if w.closed:
            return "connection"
        if time.monotonic() - w.moved > self.lease_s:
            return "lease"
        return None

    def _claim(self, seat: Seat) -> bool:
        key = self.keys.claim(seat.round, seat.group_rank)
        got = self.store.compare_set(key, "", self.me)
        return bool(got == self.me.encode())

    def _taken(self, lost: _Watched, watched: list[_Watched], how: str) -> Taken:
        """The generation the lost ranks join: the newest any rank of the round was in (the
        survivors may have entered it after the lost node's last beat)."""
        self._read_leases(watched)
        gens = [g for w in watched if w.lease is not None for g, _ in w.lease.ranks.values()]
        steps = {r: s for r, (_, s) in (lost.lease.ranks.items() if lost.lease else ())}
        taken = Taken(lost.seat, max(gens, default=0), steps, how)
        self.emit(
            Event.NODE_LOST,
            nodes=[f"group rank {lost.seat.group_rank}"],
            group_rank=lost.seat.group_rank,
            ranks=sorted(w[1] for w in lost.seat.workers),
            how=how,
            silent_s=round(time.monotonic() - lost.moved, 3),
            taken_by=self.me,
        )
        logger.error(
            f"node of group rank {lost.seat.group_rank} lost ({how}): this spare takes its seat, "
            f"ranks {sorted(w[1] for w in lost.seat.workers)} join generation {taken.generation}"
        )
        return taken

    def post_deaths(self, taken: Taken) -> bool:
        """Each lost rank's death in the workers' store: their survivors' listeners wake at once
        (their collectives with a dead peer may take a timeout to fail)."""
        seat = taken.seat
        try:
            store = connect((seat.master_addr, seat.master_port))
            run_id = os.environ.get(Var.RUN_ID.value) or self.run_id
            namespace = run_namespace(run_id, str(seat.round))
            for _, global_rank, *_ in seat.workers:
                step = taken.steps.get(global_rank, -1)
                raw = death_record(global_rank, taken.generation, step, "was lost with its node")
                publish_fault(store, namespace, taken.generation, global_rank, raw)
            return True
        except Exception as e:  # the survivors still notice: their collectives with it fail
            logger.warning(f"could not post the lost ranks' deaths: {e}")
            return False


def spare_id() -> str:
    """This spare among the job's nodes: its host and agent's pid."""
    return f"{socket.gethostname()}:{os.getpid()}"


def seat_workers(seat: Seat) -> list[Any]:
    """torch's ``Worker`` records of the seat's ranks."""
    from torch.distributed.elastic.agent.server.api import Worker

    return [
        Worker(local_rank=lr, global_rank=gr, role_rank=rr, world_size=ws, role_world_size=rws)
        for lr, gr, rr, ws, rws in seat.workers
    ]
