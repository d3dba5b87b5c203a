"""Which nodes the agent counts as waiting at the rendezvous: what makes torch's agent restart a
healthy group (``num_nodes_waiting() > 0``).

torchrun restarts the group for any node that waits. Here those are (a) the *members* of the
running round that wait to re-join (a peer whose worker died), or every waiting node with
``admit_waiting`` (torchrun's behaviour); a new node otherwise waits as a spare, said once in a
``spare_waiting`` event; plus (b) one if a member vanished from the rendezvous: its keep-alive
expired (a lost node, ``node_lost``), which torch's agent would notice only when its own workers
fail.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from loguru import logger

from resilient.events import Event
from resilient.launcher.elastic import RendezvousView


class Membership:
    """The running round's nodes (``members``, set when workers start) and the count above."""

    def __init__(self, emit: Callable[..., None], admit_waiting: bool) -> None:
        self.emit = emit
        self.admit_waiting = admit_waiting
        self.members: set[Any] | None = None
        self.spares: frozenset[Any] = frozenset()  # the nodes that wait as spares, as last said
        self.lost_reported = False

    def round_started(self, state: RendezvousView) -> None:
        self.members = set(state.participants)
        self.lost_reported = False

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
        lost = self.members - state.participants - queued
        if lost and not state.closed and not self.lost_reported:
            self.lost_reported = True
            self.emit(Event.NODE_LOST, nodes=sorted(str(x) for x in lost))
            logger.error(f"node(s) {sorted(str(x) for x in lost)} left the rendezvous: restarting")
        return waiting + (1 if lost and not state.closed else 0)
