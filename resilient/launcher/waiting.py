"""Which nodes the agent counts as waiting at the rendezvous: what makes torch's agent restart a
healthy group (``num_nodes_waiting() > 0``).

torchrun restarts the group for any node that waits. Here those are (a) the *members* of the
running round that wait to re-join (a peer whose worker died), or every waiting node with
``admit_waiting`` (torchrun's behaviour); a new node otherwise waits as a spare, said once in a
``spare_waiting`` event; plus (b) one if a member vanished from the rendezvous: its keep-alive
expired (a lost node, ``node_lost``), which torch's agent would notice only when its own workers
fail. A lost member whose seat a spare node took (:mod:`resilient.launcher.spare`) counts for
nothing: its ranks were started on the spare and its survivors stay (``node_replaced``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from loguru import logger

from resilient.events import Event
from resilient.launcher.elastic import RendezvousView


class Membership:
    """The running round's nodes (``members``, set when workers start) and the count above.

    ``taken(group_rank)``: a spare node claimed that member's seat (it took the lost node's
    ranks; :mod:`resilient.launcher.spare`), so its loss restarts nothing; ``spares()``: how many
    spare nodes park to do so, for whom a lost member waits up to ``grace_s`` before it counts."""

    def __init__(
        self,
        emit: Callable[..., None],
        admit_waiting: bool,
        taken: Callable[[int], bool] = lambda group_rank: False,
        spares: Callable[[], int] = lambda: 0,
        grace_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.emit = emit
        self.admit_waiting = admit_waiting
        self.taken = taken
        self.spares_parked = spares
        self.grace_s = grace_s
        self.clock = clock
        self.members: set[Any] | None = None
        self.ranks: dict[Any, int] = {}  # each member's group rank
        self.spares: frozenset[Any] = frozenset()  # the nodes that wait as spares, as last said
        self.lost_reported = False
        self.replaced: set[Any] = set()  # lost members whose seats a spare took
        self._lost_since: float | None = None

    def round_started(self, state: RendezvousView) -> None:
        self.members = set(state.participants)
        self.ranks = dict(state.ranks)
        self.lost_reported = False
        self.replaced = set()
        self._lost_since = None

    def count(self, n: int, state: RendezvousView | None) -> int:
        """The nodes waiting, as torch's agent should count them (``n``: as torch counts them)."""
        if state is None or self.members is None:
            return n
        queued = state.wait_list
        waiting = len(queued) if self.admit_waiting else len(queued & self.members)
        spares = frozenset(queued - self.members) if not self.admit_waiting else frozenset()
        if spares != self.spares:  # (a change: said once, not at every poll)
            self.spares = spares
            if spares:
                self.emit(Event.SPARE_WAITING, nodes=sorted(str(x) for x in spares))
        lost = self._lost(state)
        if lost and not self.lost_reported:
            self.lost_reported = True
            self.emit(Event.NODE_LOST, nodes=sorted(str(x) for x in lost))
            logger.error(f"node(s) {sorted(str(x) for x in lost)} left the rendezvous: restarting")
        return waiting + (1 if lost else 0)

    def _lost(self, state: RendezvousView) -> set[Any]:
        """The members gone from the rendezvous that no spare took the place of (one that may
        still be taken waits ``grace_s``)."""
        assert self.members is not None
        if state.closed:
            return set()
        gone = self.members - state.participants - state.wait_list - self.replaced
        for node in [x for x in gone if x in self.ranks and self.taken(self.ranks[x])]:
            self.replaced.add(node)
            gone.discard(node)
            self.emit(Event.NODE_REPLACED, nodes=[str(node)], group_rank=self.ranks[node])
            logger.warning(f"node {node} left the rendezvous; a spare node took its seat: no restart")
        if not gone:
            self._lost_since = None
            return gone
        now = self.clock()
        self._lost_since = self._lost_since or now
        if now - self._lost_since < self.grace_s and self.spares_parked() > 0:
            return set()
        return gone
