"""The store protocol between ranks: connection, fault posting, barriers between generations.

One long-lived ``TCPStore`` per run (under torchrun, the agent's store when it offers one; else
rank 0 hosts it). Every key lives under ``resilient/<run_id>/a<attempt>/g<generation>/`` so a
relaunched worker group (new attempt) or a new generation never reads stale keys, and each
process group is built on its own prefix (pytorch#55967: re-initializing on the same prefix hangs).

Keys of generation g:
- ``fault``                 the primary fault record (first ``compare_set`` wins; every rank reads it)
- ``fault/<rank>``          each rank's own observation, for the diagnosis
- ``recover/<rank>``, ``recover/count``, ``recover/release``   barrier after a fault
- ``done/count``, ``done/release``                            barrier when the function returned
A ``release`` value other than ``ok`` (or ``ok`` + a newline + the barrier's result) aborts the
barrier with the reason it carries.

How a barrier is met (O(1) requests per rank, through the node's store where a rank has one):
:mod:`resilient.runtime.coordination.barriers`.
docs/control-plane.md lists every key, who writes and reads it, and how often.
"""

from __future__ import annotations

import contextlib
import functools
import json
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from resilient.contract import FAULTED, generation_key, publish_fault
from resilient.errors import CoordinationError, PeerAborted
from resilient.launch_env import Endpoint, LaunchEnv
from resilient.runtime.coordination.agreement import REDUCE, RestorePlan, restore_plan
from resilient.runtime.coordination.barriers import NEVER, OK, Barrier, Barriers
from resilient.runtime.coordination.node import NodeLink, NodeLinkLost
from resilient.runtime.faults.records import FaultRecord

CLOSED = "__closed__"  # written to a generation's fault key once every rank finished it
FOREVER = 365 * 24 * 3600.0  # store-client timeout for a thread that blocks until a fault arrives


def endpoint_from_env(environ: Mapping[str, str] | None = None) -> Endpoint:
    """Where the store is and who we are, from torchrun's env:// variables (or a single process)."""
    return LaunchEnv.from_environ(environ).endpoint


def connect(ep: Endpoint, timeout: float) -> dist.TCPStore:
    """Open a store connection (hosting the server on rank 0 when no agent store exists)."""
    try:
        return dist.TCPStore(
            ep.host,
            ep.port,
            ep.world_size if ep.hosts_store else None,
            ep.hosts_store,
            timeout=timedelta(seconds=timeout),
            wait_for_workers=False,
            multi_tenant=ep.hosts_store,
        )
    except Exception as e:
        raise CoordinationError(f"cannot reach the store at {ep.host}:{ep.port}: {e}") from e


def client(host: str, port: int, timeout: float) -> dist.TCPStore:
    """A second connection to an existing store, for a thread that must not share the main one."""
    return dist.TCPStore(host, port, None, False, timeout=timedelta(seconds=timeout), wait_for_workers=False)


def agree_run_id(store: dist.Store, environ: Mapping[str, str] | None = None) -> str:
    """The run id: RESILIENT_RUN_ID, else torchrun's TORCHELASTIC_RUN_ID, else one rank 0's choice."""
    named = LaunchEnv.from_environ(environ).run_id
    if named is not None:
        return named
    proposal = uuid.uuid4().hex[:12]
    return store.compare_set("resilient/run_id", "", proposal).decode()


def _release(store: dist.Store, key: str, verdict: str) -> None:
    store.compare_set(key, "", verdict)


class Coordinator:
    """Generation-scoped key protocol on the run's store (main-thread connection), through the
    node's store where this rank has one (``node``; ``blocks``: the job's barriers take blocks,
    which every rank of a job agrees on, linked or not)."""

    def __init__(
        self,
        store: dist.Store,
        namespace: str,
        rank: int,
        world_size: int,
        barrier_timeout: float,
        *,
        blocks: bool = False,
        node: NodeLink | None = None,
        on_lost: Callable[[str], None] | None = None,
    ):
        self.store = store
        self.ns = namespace
        self.rank = rank
        self.world_size = world_size
        self.barrier_timeout = barrier_timeout
        self.blocks = blocks
        self.node = node
        self.on_lost = on_lost  # (any thread) the node's store is gone: why
        self._lost_lock = threading.Lock()
        # the barriers are their own job: they read this coordinator's stores and node link live
        self.barriers = Barriers(self)

    def key(self, generation: int, *parts: object) -> str:
        return generation_key(self.ns, generation, *parts)

    # -- the node's store -----------------------------------------------------------------------
    def lose(self, e: BaseException) -> NodeLinkLost:
        """The node's store failed under us: from now on this rank uses the job's store alone.
        Reported once (``on_lost``), whichever thread saw it first."""
        with self._lost_lock:
            node, self.node = self.node, None
            if node is not None and node.lost is None:
                node.lost = f"{type(e).__name__}: {e}".splitlines()[0]
                if self.on_lost is not None:
                    self.on_lost(node.lost)
        return NodeLinkLost(f"rank {self.rank}: the node's store is gone ({node.lost if node else e})")

    def _node_call(self, fn: Callable[[dist.Store], Any], store: str = "store") -> tuple[bool, Any]:
        """``fn(node's store)``: (True, its result), or (False, None) with no link (or one lost
        now: reported, and the caller goes on with the job's store)."""
        node = self.node
        if node is None:
            return False, None
        try:
            return True, fn(getattr(node, store))
        except dist.DistNetworkError as e:
            self.lose(e)
            return False, None

    # -- faults ---------------------------------------------------------------------------------
    def post_fault(
        self, rec: FaultRecord, store: dist.Store | None = None, known: FaultRecord | None = None
    ) -> FaultRecord:
        """Publish this rank's observation; return the generation's primary fault (maybe ours).
        ``known``: the primary this rank already heard of; then the job's store is not asked again
        (on a linked rank, the observation stays on the node's store)."""
        s = store or self.store
        raw = rec.to_json()
        which = "monitor" if store is not None else "store"
        own, done = self.key(rec.generation, "fault", rec.rank), self.key(rec.generation, "done", "release")
        if known is not None:
            posted, _ = self._node_call(lambda ns: ns.set(own, raw), which)
            if not posted:
                s.set(own, raw)
            # (ranks of this node that already returned wait in the done barrier here)
            self._node_call(lambda ns: ns.compare_set(done, "", FAULTED), which)
            return known
        # (which also wakes the ranks that already returned and wait in the done barrier)
        primary = publish_fault(s, self.ns, rec.generation, rec.rank, raw)
        self._node_call(lambda ns: ns.compare_set(done, "", FAULTED), which)
        return FaultRecord.parse(primary, rec.generation)

    def primary_fault(self, generation: int, store: dist.Store | None = None) -> FaultRecord | None:
        s = store or self.store
        k = self.key(generation, "fault")
        if not s.check([k]):
            return None
        raw = s.get(k)
        return None if raw == CLOSED.encode() else FaultRecord.parse(raw, generation)

    def wait_fault(self, generation: int, store: dist.Store) -> FaultRecord | None:
        """Block until generation's fault key is written; the record, or None if it closed cleanly.
        (``get`` itself waits for the key: one request, on a connection that never times out.)
        A linked rank waits on its node's store, where the node's leader copies what it hears."""
        k = self.key(generation, "fault")
        node = self.node
        if node is not None and not node.leader:
            try:
                raw = node.listener.get(k)
            except dist.DistNetworkError as e:
                # the leader left: after a clean finish it closed the generation first, so a
                # closed key on the job's store means nothing was lost
                if store.compare_set(k, NEVER, NEVER).decode() == CLOSED:
                    return None
                self.lose(e)
                raw = store.get(k)
        else:
            raw = store.get(k)
            if node is not None:  # the leader relays it to the node (its own server: cannot fail)
                node.listener.compare_set(k, "", raw.decode())
        return None if raw == CLOSED.encode() else FaultRecord.parse(raw, generation)

    def close_generation(self, generation: int) -> None:
        """After every rank finished: release listeners blocked on this generation's fault key."""
        k = self.key(generation, "fault")
        linked, _ = self._node_call(lambda ns: ns.compare_set(k, "", CLOSED))
        if not linked or self.node is None or self.node.leader:
            self.store.compare_set(k, "", CLOSED)

    def observations(self, generation: int) -> list[dict[str, object]]:
        """Every rank's own account of the fault, for the diagnosis (a linked rank's peers on other
        nodes posted theirs to their nodes' stores: the job's store holds the ones that posted there)."""
        out = {}
        for s in [self.store] + ([self.node.store] if self.node is not None else []):
            for r in range(self.world_size):
                k = self.key(generation, "fault", r)
                with contextlib.suppress(dist.DistNetworkError):
                    if r not in out and s.check([k]):
                        out[r] = json.loads(s.get(k))
        return [out[r] for r in sorted(out)]

    # -- barriers (met by self.barriers) -------------------------------------------------------
    def _barrier(self, generation: int, name: str, payload: str, reduce: Callable[[list[str]], str]) -> str:
        """Every rank arrives with ``payload``; every rank leaves with ``reduce(every payload)``,
        computed once, by the last to arrive."""
        at = Barrier(
            self.key(generation, name), f"{name!r} of generation {generation}", reduce, self.barrier_timeout
        )
        verdict = self.barriers.arrive(at, payload)
        if not verdict.startswith(f"{OK}\n"):
            raise PeerAborted(f"generation {generation} cannot form: {verdict}")
        return verdict[len(OK) + 1 :]

    def exchange(self, generation: int, name: str, payload: str) -> list[str]:
        """A barrier that also gathers one string from every rank (a small all-gather: O(N) bytes
        to every rank; where one value is needed, :meth:`agree` sends one)."""
        return list(json.loads(self._barrier(generation, name, payload, json.dumps)))

    def agree(self, generation: int, name: str, payload: str, how: str) -> str:
        """A barrier that returns one value made of every rank's: ``how`` is a key of :data:`REDUCE`."""
        return self._barrier(generation, name, payload, REDUCE[how])

    def same(self, name: str, value: str, timeout: float) -> bool:
        """Whether every rank holds ``value`` (a barrier outside any generation's keys)."""
        at = Barrier(f"{self.ns}/{name}", repr(name), REDUCE["same"], timeout)
        verdict = self.barriers.arrive(at, value)
        if not verdict.startswith(f"{OK}\n"):
            raise PeerAborted(f"{name}: {verdict}")
        return verdict[len(OK) + 1 :] == "1"

    def depart(self, generation: int, hosting: bool, timeout: float = 10.0) -> None:
        """Every rank is about to exit after this generation's last barrier. The rank that hosts
        the store waits (``timeout`` at most) until every rank has read what it needed: leaving
        first would reset its peers' connections mid-read. (A node's leader, which hosts its
        node's store, does the same for its node: see :meth:`leave_node`.)"""
        key = self.key(generation, "departed")
        n = self.store.add(key, 1)
        if not hosting:
            return
        deadline = time.monotonic() + timeout
        while n < self.world_size and time.monotonic() < deadline:
            time.sleep(0.01)
            n = self.store.add(key, 0)

    def leave_node(self, timeout: float = 5.0) -> None:
        """This process exits: its node's leader waits (``timeout`` at most) until the node's other
        live ranks said they leave too, since its node's store goes with it."""
        node = self.node
        if node is None:
            return
        try:
            n = node.store.add("left", 1)
            deadline = time.monotonic() + timeout
            while node.leader and n < node.size and time.monotonic() < deadline:
                time.sleep(0.01)
                n = node.store.add("left", 0)
        except dist.DistNetworkError:
            pass  # the leader left first (it waited as long as it would)
        node.close()
        self.node = None

    def recovery_barrier(
        self,
        generation: int,
        snapshot_steps: list[int],
        layout: str | None = None,
        live: dict[str, Any] | None = None,
    ) -> RestorePlan:
        """Wait until every rank left generation ``generation``; return the :class:`RestorePlan` of
        every rank's snapshot steps (the newest step all hold, or who holds none). ``layout``: this
        rank's DDP bucket layouts' digest, agreed in the same barrier (``layout_same``) rather
        than in a second one; ``live``: this rank's live-resume offer (the plan's ``live``)."""
        posted: Any = snapshot_steps
        if layout is not None or live is not None:
            posted = {"steps": snapshot_steps, "layout": layout}
            if live is not None:
                posted["live"] = live
        payload = json.dumps(posted)
        return RestorePlan.parse(self._barrier(generation, "recover", payload, restore_plan))

    def abort_generation(self, generation: int, reason: str) -> None:
        """Tell every rank waiting in this generation's barriers that it cannot form."""
        msg = f"rank {self.rank}: {reason}"
        for k in (self.key(generation, name, "release") for name in ("recover", "done")):
            self.store.compare_set(k, "", msg)
            self._node_call(functools.partial(_release, key=k, verdict=msg))

    def finish_barrier(self, generation: int) -> bool:
        """All ranks returned → True. A fault posted meanwhile → False (recover instead)."""
        base = self.key(generation, "done")
        try:
            verdict = self.barriers.finish(base, self.barrier_timeout)
        except CoordinationError:
            raise
        except Exception as e:
            raise CoordinationError(
                f"not every rank finished generation {generation} within {self.barrier_timeout:g}s"
            ) from e
        if verdict == OK:
            return True
        if verdict == FAULTED:
            return False
        raise PeerAborted(f"generation {generation} aborted: {verdict}")
