"""Collective fingerprints: a step is kept only if every rank issued the same collectives in it.

A rank that skips a collective (or issues an extra one) pairs every later collective of the
group with the wrong one on its peers. With NCCL, or gloo collectives of equal shape, the results
are silently wrong and the step completes; with a snapshot or a checkpoint taken after it, the
corruption would be restored as "the last good state". (Measured with gloo: rank 1 skipping one
of four equal all-reduces gives rank 0 the sum of its 2nd and rank 1's 3rd tensor, no error.)

The process group's sequence number counts every collective issued on it, DDP's bucket
all-reduces and buffer broadcasts included. Before any state is kept (a snapshot, a mirror, a
checkpoint: the same steps on every rank), each rank posts to the store how many collectives it
issued since the previous check (out of band: the desynchronized group cannot be trusted to carry
it) and compares with its ring neighbour's count for the same window. Equal counts around the
ring mean equal counts everywhere; a difference raises :class:`CollectiveDesync` before anything
is trusted. Steps between two checks cost nothing here (no store request), so the check's cost
follows the snapshot cadence, which the schedule keeps within its overhead budget.

The comparison need not hold the step up: state kept only in this process's memory (the snapshot
ring) may be kept at once and verified at the next step's end, when the neighbour's count is
normally there (one store request); a difference then drops that snapshot before the fault is
raised, and a recovery drops a snapshot still unverified. State that leaves the process (the
shared-memory mirror, a checkpoint) is compared first, waiting for the neighbour.

A rank blocked in a collective its peer never issued never reaches the next check: its watchdog
sees a hang, and :meth:`CollectiveCount.diagnose` turns it into a desync when a neighbour
completed the same window after fewer collectives than this rank has issued in it so far.

On a job linked by node (:mod:`resilient.runtime.coordination.node`), ring neighbours on one node compare on
their node's store; a node's first rank also posts to the job's store, where the previous node's
last rank reads it: the job's server sees two requests per node and check.

Point-to-point ops (a pipeline's sends and receives), which gloo numbers with the collectives and
stages issue in different numbers, are counted apart, per peer and direction, on every group
(:mod:`.p2p`), and posted with the count: what a rank sent to a peer must be what that peer
received from it; a stage that skips a send is a desync naming both ranks.

The same post carries the rank's digests of its replicated state (``sdc``, see
:mod:`resilient.state.digest`), one per replica group: each rank compares each with the next member
of that group, which is its ring neighbour for a DDP over every rank (the same read), else one more
read of that member's post (which then also goes to the job's store when that member is on another
node). A difference raises :class:`SilentCorruption`, handled like a desync.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from typing import ClassVar, NamedTuple, Protocol

import torch.distributed as dist

from resilient.detectors import p2p
from resilient.detectors.base import Detector, Run
from resilient.detectors.peer_wait import PeerWait
from resilient.detectors.replicas import SilentCorruption
from resilient.errors import SoftFault
from resilient.state.digest import Group, group_id, next_member, span

__all__ = ["CollectiveCheck", "CollectiveCount", "CollectiveDesync", "PeerWait", "issued_on_default_group"]


class CollectiveDesync(SoftFault):
    """Ranks issued different numbers of collectives in one window (recovered in-process).
    ``window_end``: the step that closed the window; state kept after it is not a good state.
    ``window_start``: the window's first step, whose start was the last state found good."""

    symptom: ClassVar[str] = "desync"
    signature_text: ClassVar[str] = "desync: ranks issued different collectives in a step"  # (counts vary)
    doubts_state: ClassVar[str | None] = "ranks issued different collectives"  # (results paired wrongly)

    def __init__(self, message: str, window_end: int, window_start: int | None = None) -> None:
        super().__init__(message)
        self.window_end = window_end
        self.window_start = window_end if window_start is None else window_start


DESYNC = CollectiveDesync.symptom


class CollectiveCheck(Detector):
    """The collective count's detector: each generation's :class:`CollectiveCount`, where the
    count is compared (``collective_check``) or carries the replica digests alone."""

    name = "collectives"
    summary = "a rank that issued other collectives than its peers in a step (its snapshot is never kept)"
    section = "collective_check"
    config = bool
    config_default = True
    config_description = (
        "compare each step's collective count across ranks before its state is kept (a rank that "
        "skipped a collective is a desync fault, never a silently wrong snapshot; point-to-point ops, "
        "a pipeline's, are compared per peer); off only where ranks legitimately issue different "
        "collectives on the default group"
    )
    faults = (CollectiveDesync,)

    @classmethod
    def build(cls, section: bool, run: Run) -> CollectiveCheck:
        return cls(section)

    def __init__(self, counts: bool) -> None:
        self.counts = counts

    def install(self) -> None:
        if self.counts:  # point-to-point ops counted apart from collectives, per peer (p2p.py)
            p2p.install()

    def uninstall(self) -> None:
        if self.counts:
            p2p.uninstall()

    def window(
        self, store: dist.Store, prefix: str, rank: int, world: int, via: NodeLinkHolder | None, digests: bool
    ) -> CollectiveCount | None:
        """A generation's count (posted under ``prefix``), where it is compared or carries the
        replica digests (``digests``); None where neither."""
        if not (self.counts or digests):
            return None
        return CollectiveCount(store, prefix, rank, world, via, counts=self.counts)


_ABSENT = "\x00absent"  # never a count: what a read of a key not posted yet returns
_BLOCKED = "blocked"  # in a hung rank's post: its main thread waits on its peers (a victim)


class _Posted(NamedTuple):
    """What a rank posted for a window: its count, its digests by replica group id, and its
    point-to-point ops by direction and peer (p2p.py)."""

    n: int  # the count
    digests: dict[str, str]
    ops: dict[str, int]

    @classmethod
    def parse(cls, raw: bytes | str) -> _Posted:
        text = raw.decode() if isinstance(raw, bytes) else raw
        n, *tokens = text.split(" ")
        pairs = [t.split("=", 1) for t in tokens if t and t != _BLOCKED]
        return cls(
            int(n) if n else -1,
            {k: v for k, v in pairs if not p2p.is_token(k)},
            {k: int(v) for k, v in pairs if p2p.is_token(k)},
        )


class NodeStores(Protocol):
    """What the count reads of its node's link (:class:`~resilient.runtime.coordination.node.NodeLink`)."""

    first: int
    store: dist.Store
    monitor: dist.Store

    def holds(self, rank: int) -> bool: ...


class NodeLinkHolder(Protocol):
    """What the count needs of the coordinator: its node link while it lasts, and the switch to
    the job's store when the node's store fails (see :meth:`Coordinator.lose`)."""

    @property
    def node(self) -> NodeStores | None: ...

    def lose(self, e: BaseException) -> BaseException: ...


def issued_on_default_group() -> int:
    """How many collectives the default process group has issued (its sequence number, less the
    point-to-point ops that took one); -1 without a group (destroyed) or on a backend that does
    not count."""
    try:
        pg = dist.distributed_c10d._get_default_group()
        return int(pg._get_sequence_number_for_group()) - p2p.TALLY.taken(pg)  # type: ignore[attr-defined]
    except (RuntimeError, ValueError, AttributeError):  # no group (destroyed), or a backend without
        return -1


class CollectiveCount:
    """Collective counts of one rank per check window, posted under ``<prefix>/<k>/<rank>`` for
    the ``k``-th check of the generation (every rank checks at the same steps), with the window's
    point-to-point ops counted by ``tally`` (p2p.py)."""

    def __init__(
        self,
        store: dist.Store,
        prefix: str,
        rank: int,
        world_size: int,
        coord: NodeLinkHolder | None = None,
        *,
        counts: bool = True,
        tally: p2p.Tally | None = None,
    ) -> None:
        self.store, self.prefix, self.rank, self.world = store, prefix, rank, world_size
        self.tally = tally if tally is not None else p2p.TALLY
        self._ops_base = self.tally.snapshot()  # the open window's point-to-point ops start here
        self.peers: set[int] = set()  # ranks this one exchanged point-to-point ops with (the generation)
        self._ops: dict[str, int] = {}  # the pending window's
        self.coord = coord  # its node link, while it lasts
        self.counts = counts  # False: the counts are posted but not compared (digests only)
        self.step: int | None = None
        self.checks = 0  # windows closed so far
        self._since: int | None = None  # the first step of the open window
        self._base = issued_on_default_group()
        self._posted: list[tuple[int, dist.Store]] = []  # own keys not yet deleted, and where
        self._pending: tuple[int, int, int, int] | None = None  # (k, count, first step, last step)
        self._digests: Mapping[Group, str] = {}  # the pending window's, by replica group
        self.wait: PeerWait | None = None  # what the main thread waits for now, if anything
        self.on_wait_end: Callable[[PeerWait, float], None] | None = None  # a reported wait ended

    def _key(self, k: int, rank: int) -> str:
        return f"{self.prefix}/{k}/{rank}"

    def begin(self, step: int) -> None:
        self.step = step
        if self._since is None:
            self._since = step

    def carry(self, since: int) -> None:
        """The generation resumed state that no check has found good since step ``since`` (a
        live resume keeps what the last generation's open window held): its first window
        reaches back there, so that a silent fault found in it names where it may have begun."""
        self._since = since

    @contextlib.contextmanager
    def uncounted(self) -> Iterator[None]:
        """Leave what is issued inside out of the window: collectives of this rank alone, such as
        a handover's transfer to a replacement, which the other ranks never issue."""
        seq, ops = issued_on_default_group(), self.tally.snapshot()
        try:
            yield
        finally:
            self._base += issued_on_default_group() - seq
            self._ops_base.update(self.tally.since(ops))

    def issued(self) -> int:
        """Collectives this rank issued in the open window."""
        return issued_on_default_group() - self._base

    @property
    def window_start(self) -> int | None:
        """The first step no check has found good yet: a window still to compare, else the open
        one's (a desync the hang monitor diagnoses happened in one of them)."""
        if self._pending is not None:
            return self._pending[2]
        return self._since if self._since is not None else self.step

    @property
    def pending(self) -> int | None:
        """The step that closed a window whose neighbour's count was not compared yet."""
        return self._pending[3] if self._pending is not None else None

    def close_window(self, step: int, digests: Mapping[Group, str] | None = None) -> None:
        """Post this rank's count (and ``digests``: of its replicated state, by replica group)
        for the window ending with ``step`` and return at once; the comparison follows in
        :meth:`settle` (state kept meanwhile is unverified). A window still unsettled is settled
        first, waiting if need be."""
        if self._pending is not None:
            self.settle(block=True)
        seq, ops = issued_on_default_group(), self.tally.since(self._ops_base)
        n, since = seq - self._base, self._since if self._since is not None else step
        k = self.checks
        digests = digests or {}
        self.peers |= p2p.peers_in(ops) - {self.rank}
        tokens = [f"{group_id(g)}={d}" for g, d in digests.items()] + p2p.encode(ops, self.peers)
        value = " ".join([str(n), *tokens])
        try:
            self._post(k, value, self._stores_to_post(digests))
        except dist.DistNetworkError as e:  # the node's store died: post where the neighbour reads now
            assert self.coord is not None
            self.coord.lose(e)
            self._post(k, value, [self.store])
        self.checks, self._base, self._since = k + 1, seq, None
        self._ops_base.update(ops)
        if self.world > 1:
            self._pending, self._digests, self._ops = (k, n, since, step), digests, ops

    def settle(self, block: bool, running: bool = True) -> bool:
        """Compare the pending window with the next rank's count: True once compared (or nothing
        was pending), False if ``block`` is off and the neighbour has not posted yet. Raises
        :class:`CollectiveDesync` when the counts differ. ``running``: the ranks are still
        stepping (not in a recovery), so a replica group's members will post this window."""
        if self._pending is None:
            return True
        k, n, since, step = self._pending
        peer = (self.rank + 1) % self.world
        posts: dict[int, _Posted] = {}
        members = {next_member(g, self.rank) for g in self._digests}
        for p in [peer, *sorted((members | (self.peers if self.counts else set())) - {peer})]:
            key = self._key(k, p)
            got = self._read(key, p)
            if got is None and not block:
                return False
            posts[p] = got if got is not None else self._await(key, p)
        self._pending = None
        other = posts[peer].n
        where = f"step {step}" if since == step else f"steps {since}-{step}"
        if self.counts and other != n:
            raise CollectiveDesync(
                f"collective desync in {where}: rank {self.rank} issued {n} collectives, "
                f"rank {peer} issued {other}; the state is not kept",
                window_end=step,
                window_start=since,
            )
        for p in sorted(self.peers) if self.counts else ():
            why = p2p.mismatch(self.rank, self._ops, p, posts[p].ops)
            if why is not None:
                msg = f"point-to-point desync in {where}: {why}; state not kept"
                raise CollectiveDesync(msg, step, since)
        for group, mine in self._digests.items():
            p = next_member(group, self.rank)
            theirs = posts[p].digests.get(group_id(group))
            if theirs != mine:
                if running:
                    self._await_group(k, group, posts)
                raise SilentCorruption(
                    f"replicas differ after step {step}: rank {self.rank}'s state replicated over ranks "
                    f"{span(group)} has digest {mine}, rank {p}'s {theirs}; the state is not kept",
                    window_end=step,
                    window_start=since,
                    ranks=(self.rank, p),
                )
        if k > 1 and (n > 0 or self._readers_past(k, posts)):
            # A collective that completed in window k means every rank closed window k-1, and a
            # rank settles each window before it closes the next: every read of windows before
            # k-1 is done. Window k-1 itself may still be read (its settle is lazy: a slower
            # predecessor compares it at the end of its next step), so it stays.
            for old, held in [p for p in self._posted if p[0] < k - 1]:
                with contextlib.suppress(dist.DistNetworkError):  # (a lost node's store, keys and all)
                    held.delete_key(self._key(old, self.rank))
            self._posted = [p for p in self._posted if p[0] >= k - 1]
        return True

    def _readers_past(self, k: int, posts: Mapping[int, _Posted]) -> bool:
        """No collective on the default group in window ``k``: each rank reading this one's posts
        closed window ``k-1`` if its post was read in this settle or is there now (never awaited)."""
        readers = {
            (self.rank - 1) % self.world,
            *self.peers,
            *(next_member(g[::-1], self.rank) for g in self._digests),
        }
        return all(
            p in posts or self._read(self._key(k - 1, p), p) is not None for p in readers - {self.rank}
        )

    def _await_group(self, k: int, group: Group, posts: Mapping[int, _Posted]) -> None:
        """Replicas differ in window ``k``: before the fault is raised (and every rank pulled out
        of its step), every member of ``group`` this rank can read has posted the window, so each
        holds its digest for the recovery's attribution (a majority needs them all)."""
        node = self.coord.node if self.coord is not None else None
        for m in group:
            if m != self.rank and m not in posts and (node is None or node.holds(m)):
                self._await(self._key(k, m), m)

    def check(self, step: int) -> None:
        """Close the window at the end of ``step`` and compare it now (blocks until the next rank
        closed the same window; a peer that never does is a hang, and the watchdog's)."""
        self.close_window(step)
        self.settle(block=True)

    def _post(self, k: int, value: str, stores: list[dist.Store]) -> None:
        for where in stores:
            where.set(self._key(k, self.rank), value)
            self._posted.append((k, where))

    def _stores_to_post(self, digests: Mapping[Group, str]) -> list[dist.Store]:
        """The node's store (for the neighbour on this node) and, for a node's first rank (whose
        ring predecessor is on the node before), a rank whose predecessor in a replica group is on
        another node, or an unlinked rank, the job's."""
        node = self.coord.node if self.coord is not None else None
        if node is None:
            return [self.store]
        readers = [g[(g.index(self.rank) - 1) % len(g)] for g in digests] + sorted(self.peers)
        if self.rank == node.first or not all(node.holds(r) for r in readers):
            return [node.store, self.store]
        return [node.store]

    def _read(self, key: str, peer: int) -> _Posted | None:
        """The neighbour's count, or None if not posted yet: one request (a compare-and-set that
        never matches returns the value, or our sentinel when the key is absent, creating nothing)."""
        coord = self.coord
        node = coord.node if coord is not None else None
        raw: bytes | None = None
        if coord is not None and node is not None and node.holds(peer):
            try:
                raw = node.store.compare_set(key, _ABSENT, _ABSENT)
            except dist.DistNetworkError as e:
                # the node's leader died: the neighbour falls back as this rank does and posts
                # to the job's store from now on
                coord.lose(e)
        if raw is None:
            raw = self.store.compare_set(key, _ABSENT, _ABSENT)
        return None if raw == _ABSENT.encode() else _Posted.parse(raw)

    def _await(self, key: str, peer: int) -> _Posted:
        # A blocking store wait cannot be interrupted by the runtime (the signal that ends a
        # step is only handled between bytecodes) and a timed-out wait leaves the connection out
        # of step with the server: poll instead. The peer is normally there within a collective's
        # latency (it just left the same last collective), so the first 0.3 ms poll back to back,
        # then back off to 10 ms. (Not longer: on a machine with fewer cores than busy processes
        # a spin takes the CPU from the very peer it waits for.)
        spin_until = time.perf_counter() + 0.0003
        delay = 2e-4
        w = self.wait = PeerWait(key, peer, time.monotonic())
        try:
            while (got := self._timed_read(w)) is None:
                if time.perf_counter() > spin_until:
                    time.sleep(delay)
                    delay = min(2 * delay, 0.01)
        finally:
            self.wait = None
        if w.reported and self.on_wait_end is not None:
            self.on_wait_end(w, time.monotonic() - w.since)
        return got

    def _timed_read(self, w: PeerWait) -> _Posted | None:
        w.request_since = t0 = time.monotonic()
        got = self._read(w.key, w.peer)
        w.request_since, w.reads = None, w.reads + 1
        w.slowest_s = max(w.slowest_s, time.monotonic() - t0)
        return got

    def diagnose(self, store: dist.Store, blocked: bool = False, wait_s: float = 0.0) -> str | None:
        """From the monitor thread (its own store connection), while this rank seems hung: a
        neighbour that closed the open window after fewer collectives than this rank has issued
        in it means this rank waits in a collective the neighbour never issued; point-to-point
        ops unmatched by a peer are :func:`p2p.diagnose_hang`'s (``blocked``: the main thread
        waits on its peers; ``wait_s``: how long it waits for theirs)."""
        step = self.step
        if step is None or self.world == 1 or not self.counts:
            return None
        n, k = self.issued(), self.checks
        since = self._since if self._since is not None else step
        where = f"step {step}" if since == step else f"steps {since}-{step}"
        node = self.coord.node if self.coord is not None else None
        for peer in sorted({(self.rank - 1) % self.world, (self.rank + 1) % self.world}):
            key = self._key(k, peer)
            s = node.monitor if node is not None and node.holds(peer) else store
            try:
                if not s.check([key]):
                    continue
                other = _Posted.parse(s.get(key)).n
            except Exception:  # the store is unreachable: no diagnosis, the hang stands
                return None
            if other < n:
                return (
                    f"collective desync in {where}: rank {peer} reached the next check after {other} "
                    f"collectives, rank {self.rank} has issued {n} since the last one and waits in the last"
                )
        ops = self.tally.since(self._ops_base)
        peers = (self.peers | p2p.peers_in(ops)) - {self.rank}
        if not peers:
            return None
        mine = " ".join(["", *p2p.encode(ops, peers), *([_BLOCKED] if blocked else [])])

        def read(p: int) -> tuple[bool, dict[str, int], bool] | None:
            s = node.monitor if node is not None and node.holds(p) else store
            for suffix, closed in (("", True), ("/hung", False)):
                raw = s.compare_set(self._key(k, p) + suffix, _ABSENT, _ABSENT)
                if raw != _ABSENT.encode():
                    return closed, _Posted.parse(raw).ops, _BLOCKED in raw.decode().split()
            return None

        try:  # (posted where each peer reads it: its node's store, or the job's)
            for s in [store] if node is None else [store, node.monitor]:
                s.set(self._key(k, self.rank) + "/hung", mine)
            return p2p.diagnose_hang(self.rank, ops, peers, where, read, blocked=blocked, wait_s=wait_s)
        except Exception:  # the store is unreachable: no diagnosis, the hang stands
            return None
