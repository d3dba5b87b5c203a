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

Barriers cost O(1) requests per rank at any size: each rank posts its payload and counts itself
in; the last to arrive reads every payload once, reduces them (the step every rank can restore,
any/all of a vote, rank 0's choice) and writes the result into the release key every rank reads.
(Every rank reading every payload was O(N²) keys at the server: 268 M at 16,384 ranks.)
docs/control-plane.md lists every key, who writes and reads it, and how often.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from resilient.errors import CoordinationError, PeerAborted
from resilient.launch_env import Endpoint, LaunchEnv
from resilient.runtime.faults import FaultRecord


def restore_plan(payloads: list[str]) -> str:
    """The recovery barrier's reduction: the newest snapshot step every rank holds (``step``),
    the ranks that hold none (``empty``), and every rank's steps only when there is no common one
    (the error names them)."""
    held = [json.loads(p) for p in payloads]
    empty = [r for r, s in enumerate(held) if not s]
    common = set(held[0]).intersection(*map(set, held[1:])) if held else set()
    plan = {"step": max(common) if common else None, "empty": empty}
    if not common and not empty:
        plan["held"] = held
    return json.dumps(plan)


REDUCE: dict[str, Callable[[list[str]], str]] = {
    "any": lambda vs: "1" if any(v == "1" for v in vs) else "0",
    "all": lambda vs: "1" if all(v == "1" for v in vs) else "0",
    "first": lambda vs: vs[0],  # rank 0's
}

OK = "ok"
_NEVER = "\x00never"  # an expected value no key holds: compare_set(k, _NEVER, _NEVER) only reads k
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


class Coordinator:
    """Generation-scoped key protocol on the run's store (main-thread connection)."""

    def __init__(self, store: dist.Store, namespace: str, rank: int, world_size: int, barrier_timeout: float):
        self.store = store
        self.ns = namespace
        self.rank = rank
        self.world_size = world_size
        self.barrier_timeout = barrier_timeout

    def key(self, generation: int, *parts: object) -> str:
        return "/".join([self.ns, f"g{generation}", *map(str, parts)])

    # -- faults ---------------------------------------------------------------------------------
    def post_fault(self, rec: FaultRecord, store: dist.Store | None = None) -> FaultRecord:
        """Publish this rank's observation; return the generation's primary fault (maybe ours)."""
        s = store or self.store
        raw = rec.to_json()
        s.set(self.key(rec.generation, "fault", rec.rank), raw)
        primary = s.compare_set(self.key(rec.generation, "fault"), "", raw)
        # wake ranks that already returned from the function and wait in the done barrier
        s.compare_set(self.key(rec.generation, "done", "release"), "", "fault")
        return FaultRecord.from_json(primary)

    def primary_fault(self, generation: int, store: dist.Store | None = None) -> FaultRecord | None:
        s = store or self.store
        k = self.key(generation, "fault")
        if not s.check([k]):
            return None
        raw = s.get(k)
        return None if raw.decode() == CLOSED else FaultRecord.from_json(raw)

    def wait_fault(self, generation: int, store: dist.Store) -> FaultRecord | None:
        """Block until generation's fault key is written; the record, or None if it closed cleanly.
        (``get`` itself waits for the key: one request, on a connection that never times out.)"""
        raw = store.get(self.key(generation, "fault"))
        return None if raw.decode() == CLOSED else FaultRecord.from_json(raw)

    def close_generation(self, generation: int) -> None:
        """After every rank finished: release listeners blocked on this generation's fault key."""
        self.store.compare_set(self.key(generation, "fault"), "", CLOSED)

    def observations(self, generation: int) -> list[dict[str, object]]:
        out = []
        for r in range(self.world_size):
            k = self.key(generation, "fault", r)
            if self.store.check([k]):
                out.append(json.loads(self.store.get(k)))
        return out

    # -- barriers -------------------------------------------------------------------------------
    def _barrier(self, generation: int, name: str, payload: str, reduce: Callable[[list[str]], str]) -> str:
        """Every rank arrives with ``payload``; every rank leaves with ``reduce(every payload)``,
        computed once, by the last to arrive."""
        self.store.set(self.key(generation, name, self.rank), payload)
        arrived = self.store.add(self.key(generation, name, "count"), 1)
        release = self.key(generation, name, "release")
        if arrived == self.world_size:
            keys = [self.key(generation, name, r) for r in range(self.world_size)]
            result = reduce([v.decode() for v in self.store.multi_get(keys)])
            self.store.compare_set(release, "", f"{OK}\n{result}")
        try:
            self.store.wait([release], timedelta(seconds=self.barrier_timeout))
        except Exception as e:
            n = self.store.add(self.key(generation, name, "count"), 0)
            raise CoordinationError(
                f"barrier {name!r} of generation {generation}: only {n}/{self.world_size} ranks arrived "
                f"within {self.barrier_timeout:g}s"
            ) from e
        # (the key exists now: a compare-and-set that never matches reads it in one request,
        # where a get would wait for it first)
        verdict = self.store.compare_set(release, _NEVER, _NEVER).decode()
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

    def depart(self, generation: int, hosting: bool, timeout: float = 10.0) -> None:
        """Every rank is about to exit after this generation's last barrier. The rank that hosts
        the store waits (``timeout`` at most) until every rank has read what it needed: leaving
        first would reset its peers' connections mid-read."""
        key = self.key(generation, "departed")
        n = self.store.add(key, 1)
        if not hosting:
            return
        deadline = time.monotonic() + timeout
        while n < self.world_size and time.monotonic() < deadline:
            time.sleep(0.01)
            n = self.store.add(key, 0)

    def recovery_barrier(self, generation: int, snapshot_steps: list[int]) -> dict[str, Any]:
        """Wait until every rank left generation ``generation``; return :func:`restore_plan` of
        every rank's snapshot steps (the newest step all hold, or who holds none)."""
        return dict(
            json.loads(self._barrier(generation, "recover", json.dumps(snapshot_steps), restore_plan))
        )

    def abort_generation(self, generation: int, reason: str) -> None:
        """Tell every rank waiting in this generation's barriers that it cannot form."""
        msg = f"rank {self.rank}: {reason}"
        for name in ("recover", "done"):
            self.store.compare_set(self.key(generation, name, "release"), "", msg)

    def finish_barrier(self, generation: int) -> bool:
        """All ranks returned → True. A fault posted meanwhile → False (recover instead)."""
        release = self.key(generation, "done", "release")
        if self.store.add(self.key(generation, "done", "count"), 1) == self.world_size:
            self.store.compare_set(release, "", OK)
        try:
            self.store.wait([release], timedelta(seconds=self.barrier_timeout))
        except Exception as e:
            raise CoordinationError(
                f"not every rank finished generation {generation} within {self.barrier_timeout:g}s"
            ) from e
        verdict = self.store.get(release).decode()
        if verdict == OK:
            return True
        if verdict == "fault":
            return False
        raise PeerAborted(f"generation {generation} aborted: {verdict}")
