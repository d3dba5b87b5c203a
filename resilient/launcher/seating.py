"""The agent's part in keeping nodes' seats (:mod:`resilient.launcher.seats`,
:mod:`resilient.launcher.spare`): a member node holds its seat and lease from each round's start;
a node that arrives while a round runs parks as a spare and may start a lost node's ranks.

Only on a c10d rendezvous (its store is where seats are kept) and with ``--replace rank`` (a lost
node's ranks are replaced as a lost rank's are; with ``--replace group`` a lost node restarts the
group, as in torchrun).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from loguru import logger
from torch.distributed.elastic.rendezvous import RendezvousGracefulExitError

from resilient.contract import beat_path, read_beat
from resilient.events import Event
from resilient.launch_env import Var
from resilient.launcher.elastic import Elastic
from resilient.launcher.replace import Replacer
from resilient.launcher.seats import Keys, Seat, SeatHolder, connect
from resilient.launcher.spare import LEASE_S, JobOver, Spare, StoreGone, Taken, spare_id

FULL_WAIT_S = 300.0  # how long a node that arrived beyond the job's nodes waits for their seats


class Seating:
    """``where``: the rendezvous store; ``count``: the workers (and standbys) a node runs;
    ``lease_s``: how long a member's lease may stand still before a spare takes its seat."""

    def __init__(
        self,
        where: tuple[str, int],
        rdzv_id: str,
        elastic: Elastic,
        replacer: Replacer,
        heartbeat_dir: Path,
        emit: Callable[..., None],
        count: int,
        lease_s: float = LEASE_S,
        max_nodes: int | None = None,
    ) -> None:
        self.where = where
        self.keys = Keys(rdzv_id)
        self.rdzv_id = rdzv_id
        self.elastic = elastic
        self.replacer = replacer
        self.heartbeat_dir = heartbeat_dir
        self.emit = emit
        self.count = count
        self.lease_s = lease_s
        self.max_nodes = max_nodes  # (a node that finds the round full waits for its seats: a spare)
        self.holder: SeatHolder | None = None
        self.taken: Taken | None = None  # the lost node's seat this spare took, until its workers start
        self.fenced: str | None = None  # who took this node's seat, if one did
        self.member = False  # it held a seat once: it joins torch's rendezvous from then on
        self.left: str | None = None  # why this spare left without the job's end (its exit: 75)
        self._store: Any = None  # (the members' reads of claims; the round's store of a taken seat)

    def _client(self) -> Any:
        if self._store is None:
            self._store = connect(self.where)
        return self._store

    # ---- a spare ---------------------------------------------------------------------------------
    def park(self, entrypoint: str, args: tuple[str, ...]) -> Taken | None:
        """Before torch's rendezvous: when a round runs that this node is not in, park as its
        spare until a seat is lost (returned, claimed) or the round ends (None: join the next
        round). The job's end ends this agent (torch's graceful rendezvous exit)."""
        if self.member:
            return None
        try:
            spare = Spare(self.where, self.rdzv_id, spare_id(), self.emit, self.lease_s)
            seats = self._seats(spare)
        except Exception as e:  # (the store not up yet: the job is starting)
            logger.debug("no running round to park beside: {}", e)
            return None
        if seats is None:
            return None
        self.emit(Event.SPARE_PARKED, round=seats[0].round, nodes=len(seats), standbys=self.count)
        logger.info(f"round {seats[0].round} runs with {len(seats)} nodes: this node parks as its spare")

        def tend() -> None:
            self.replacer.keep_spare_standbys(self.count, entrypoint, args)

        try:
            taken = spare.park(seats, tend)
        except JobOver as e:
            self.replacer.close()
            if isinstance(e, StoreGone):
                self.left = str(e)
            raise RendezvousGracefulExitError(str(e)) from e
        if taken is None:
            self.replacer.close()
            return None
        taken_at = time.monotonic()
        posted = spare.post_deaths(taken)
        self.taken, self._taken_at, self._posted = taken, taken_at, posted
        return taken

    def _seats(self, spare: Spare) -> list[Seat] | None:
        """The running round's seats. Before any runs, the nodes count their arrivals: one that
        comes after ``max_nodes`` others (every node of an allocation started at once, as srun
        does, one more than the job needs) is a spare and waits for the seats (a bounded wait:
        the members' workers are starting); the others join the rendezvous."""
        seats = spare.running()
        if seats is not None or self.max_nodes is None or spare.arrive() <= self.max_nodes:
            return seats
        deadline = time.monotonic() + FULL_WAIT_S
        while seats is None and time.monotonic() < deadline:
            time.sleep(0.2)  # (polls the store: the members publish their seats as workers start)
            seats = spare.running()
        return seats

    def take(self, worker_group: Any) -> None:
        """``worker_group`` gets the taken seat (torch's rendezvous skipped)."""
        assert self.taken is not None
        self.elastic.take_seat(worker_group, self.taken.seat, self._client())

    @contextlib.contextmanager
    def starting(self) -> Iterator[int | None]:
        """Around torch's start of the workers: a taken seat's ranks start from this node's
        standbys, joining its survivors' generation in its round (yielded: the round; None:
        the rendezvous' own)."""
        if self.taken is None:
            yield None
            return
        taken = self.taken
        os.environ[Var.JOIN_GENERATION] = str(taken.generation)
        try:
            with self.elastic.handlers(self._promote):
                yield taken.seat.round
        finally:
            os.environ.pop(Var.JOIN_GENERATION, None)  # (a later restart is a new round's start)

    def _promote(self, real: Callable[..., Any], **kw: Any) -> Any:
        sb = self.replacer.promote(
            kw["local_rank_id"], kw["env"], kw["entrypoint"], tuple(kw["args"]), kw["stdout"], kw["stderr"]
        )
        if sb is not None:
            self._warm += 1
            return sb
        return real(**kw)

    _warm = 0

    # ---- a member --------------------------------------------------------------------------------
    def started(self, worker_group: Any, round_no: int | None) -> None:
        """The workers of ``round_no`` started: this node holds its seat (published, leased)."""
        if round_no is None:
            return
        if self.taken is not None:
            t = self.taken
            self.emit(
                Event.SEAT_TAKEN,
                group_rank=t.seat.group_rank,
                ranks=sorted(w[1] for w in t.seat.workers),
                round=t.seat.round,
                join_generation=t.generation,
                how=t.how,
                warm=self._warm,
                fault_posted=self._posted,
                duration_s=round(time.monotonic() - self._taken_at, 4),
            )
            self.taken = None
        self.member = True
        if self.holder is None:
            self.holder = SeatHolder(self.where, self.rdzv_id, self._ranks, self._on_fenced, spare_id())
        seat = Seat(
            round=round_no,
            group_rank=int(worker_group.group_rank),
            group_world_size=int(worker_group.group_world_size),
            master_addr=str(worker_group.master_addr),
            master_port=int(worker_group.master_port),
            workers=tuple(
                (w.local_rank, w.global_rank, w.role_rank, w.world_size, w.role_world_size)
                for w in worker_group.workers
            ),
            host=self.holder.host,
            port=self.holder.port,
        )
        self.holder.hold(seat)

    def _ranks(self) -> dict[int, tuple[int, int]]:
        out = {}
        for w in self.elastic.workers():
            beat = read_beat(beat_path(self.heartbeat_dir, w.local_rank))
            if beat is not None:
                out[w.global_rank] = (beat.generation, beat.step)
        return out

    def _on_fenced(self, by: str) -> None:
        self.fenced = by

    def seat_taken(self, group_rank: int) -> bool:
        """A spare claimed member ``group_rank``'s seat in the round this node runs."""
        seat = self.holder.seat if self.holder is not None else None
        if seat is None:
            return False
        with contextlib.suppress(Exception):
            return bool(self._client().check([self.keys.claim(seat.round, group_rank)]))
        return False

    def spares(self) -> int:
        """How many spare nodes park."""
        with contextlib.suppress(Exception):
            return int(self._client().add(self.keys.spares(), 0))
        return 0

    def close(self, bye: bool) -> None:
        if self.holder is not None:
            self.holder.close(bye)
            self.holder = None
