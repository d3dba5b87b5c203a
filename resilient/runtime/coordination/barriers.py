"""The barriers between a run's ranks on the job's store, met on the node's store first where a rank
has one: every rank arrives with a payload and leaves with one verdict made of all of them.

Barriers cost O(1) requests per rank at any size: each rank posts its payload and counts itself
in; the last to arrive reads every payload once, reduces them (the step every rank can restore,
any/all of a vote, rank 0's choice) and writes the result into the release key every rank reads.
(Every rank reading every payload was O(N²) keys at the server: 268 M at 16,384 ranks.)
When the job spans several nodes, a node's ranks meet on their node's own store first and reach
the job's as one (:mod:`resilient.runtime.coordination.node`): a barrier's payloads then arrive in blocks
(``<name>/b/<first rank>``, listed in ``<name>/blocks``), each counting as many ranks as it holds.
The keys' names and generations are the :class:`~resilient.runtime.coordination.coordinator.Coordinator`'s.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

import torch.distributed as dist

from resilient.errors import CoordinationError
from resilient.runtime.coordination.node import NodeLink, NodeLinkLost

OK = "ok"
NEVER = "\x00never"  # an expected value no key holds: compare_set(k, NEVER, NEVER) only reads k


@dataclass(frozen=True)
class Barrier:
    base: str  # its keys' prefix
    label: str  # its name in an error
    reduce: Callable[[list[str]], str]
    timeout: float


class Seat(Protocol):
    """What the barriers read of this rank's coordinator, live (its node link may be set or lost
    at any time): the stores, who this rank is, and how a lost node link is dropped."""

    store: dist.Store
    rank: int
    world_size: int
    blocks: bool
    node: NodeLink | None

    def lose(self, e: BaseException) -> NodeLinkLost: ...


class Barriers:
    """This rank's arrivals at the job's barriers, through its node's store where it has one
    (``blocks``: the job's barriers take blocks, which every rank of a job agrees on, linked or not)."""

    def __init__(self, seat: Seat):
        self.seat = seat

    def arrive(self, at: Barrier, payload: str) -> str:
        """Arrive at barrier ``at`` with ``payload``; the release key's raw verdict."""
        node = self.seat.node
        if node is not None:
            return self._node_arrive(node, at, payload)
        return self._job_arrive(at, self.seat.rank, [payload])

    def _job_arrive(self, at: Barrier, first: int, payloads: list[str]) -> str:
        """Arrive at the job's barrier ``base`` for ranks ``first ...`` with their payloads; the
        last arrival reduces every rank's payload once. Returns the release key's raw verdict."""
        s, base = self.seat.store, at.base
        if self.seat.blocks:
            s.set(f"{base}/b/{first}", json.dumps(payloads))
            s.append(f"{base}/blocks", f"{first},")  # type: ignore[attr-defined]
        else:
            s.set(f"{base}/{first}", payloads[0])
        arrived = s.add(f"{base}/count", len(payloads))
        release = f"{base}/release"
        if arrived == self.seat.world_size:
            # the verdict written, or the abort a peer wrote first: the last arrival, on the
            # recovery's critical path, needs no wait and no second read
            return s.compare_set(release, "", self._reduce(at)).decode()
        try:
            s.wait([release], timedelta(seconds=at.timeout))
        except Exception as e:
            raise self._late(at) from e
        # (the key exists now: a compare-and-set that never matches reads it in one request,
        # where a get would wait for it first)
        return s.compare_set(release, NEVER, NEVER).decode()

    def _reduce(self, at: Barrier) -> str:
        """(The last arrival) every payload, read once and reduced: the release key's verdict. A
        malformed block or payload (a peer's garbage) aborts the barrier for every rank, named."""
        s, base, world = self.seat.store, at.base, self.seat.world_size
        try:
            if self.seat.blocks:
                firsts = sorted(int(f) for f in s.get(f"{base}/blocks").decode().split(",") if f)
                got = [p for v in s.multi_get([f"{base}/b/{f}" for f in firsts]) for p in json.loads(v)]
                if not all(isinstance(p, str) for p in got):
                    raise ValueError("a block holds a payload that is not a string")
            else:
                got = [v.decode() for v in s.multi_get([f"{base}/{r}" for r in range(world)])]
            if len(got) != world:
                raise ValueError(f"{len(got)} payloads for {world} ranks")
            return f"{OK}\n{at.reduce(got)}"
        except (ValueError, TypeError, RecursionError) as e:
            return f"barrier {at.label}: malformed payload ({type(e).__name__}: {e})"

    def _late(self, at: Barrier) -> CoordinationError:
        n = self.seat.store.add(f"{at.base}/count", 0)
        return CoordinationError(
            f"barrier {at.label}: only {n}/{self.seat.world_size} ranks arrived within {at.timeout:g}s"
        )

    def _node_arrive(self, node: NodeLink, at: Barrier, payload: str) -> str:
        """The same through the node's store: the node's last arrival carries every payload of
        the node to the job's barrier as one block, and hands the verdict back to the node."""
        ns, base = node.store, at.base
        try:
            ns.set(f"{base}/{self.seat.rank}", payload)
        except dist.DistNetworkError as e:  # gone before this rank counted in: it arrives alone
            self.seat.lose(e)
            return self._job_arrive(at, self.seat.rank, [payload])
        try:
            if ns.add(f"{base}/count", 1) == node.size:
                got = [v.decode() for v in ns.multi_get([f"{base}/{r}" for r in node.ranks])]
                try:
                    verdict = self._job_arrive(at, node.first, got)
                except CoordinationError as e:
                    ns.compare_set(f"{base}/release", "", str(e))
                    raise
                return ns.compare_set(f"{base}/release", "", verdict).decode()  # (as in _job_arrive)
            try:
                ns.wait([f"{base}/release"], timedelta(seconds=at.timeout))
            except dist.DistNetworkError:
                raise
            except Exception as e:
                raise self._late(at) from e
            return ns.compare_set(f"{base}/release", NEVER, NEVER).decode()
        except dist.DistNetworkError as e:
            # the node's leader died: its peers cannot complete this barrier without it anyway
            raise CoordinationError(str(self.seat.lose(e))) from e

    def finish(self, base: str, timeout: float) -> str:
        """Count this rank in at the barrier ``base`` of ranks whose function returned (no
        payload: a fault posted meanwhile writes its release first); the release key's raw verdict."""
        within = timedelta(seconds=timeout)
        node = self.seat.node
        if node is None:
            return self._job_count(base, 1, within)
        ns = node.store
        try:
            arrived = ns.add(f"{base}/count", 1)
        except dist.DistNetworkError as e:  # gone before this rank counted in: it arrives alone
            self.seat.lose(e)
            return self._job_count(base, 1, within)
        try:
            if arrived == node.size:  # the node's last: counts the node in
                ns.compare_set(f"{base}/release", "", self._job_count(base, node.size, within))
            ns.wait([f"{base}/release"], within)
            return ns.compare_set(f"{base}/release", NEVER, NEVER).decode()
        except dist.DistNetworkError as e:
            raise CoordinationError(str(self.seat.lose(e))) from e

    def _job_count(self, base: str, weight: int, timeout: timedelta) -> str:
        s, release = self.seat.store, f"{base}/release"
        if s.add(f"{base}/count", weight) == self.seat.world_size:
            s.compare_set(release, "", OK)
        s.wait([release], timeout)
        return s.compare_set(release, NEVER, NEVER).decode()
