"""A node's seat in the running round, kept in the rendezvous store: what a spare node needs to
take it when the node is lost, and the lease that says it is not.

torch elastic notices a lost node when its rendezvous keep-alive expires, then restarts every
worker of every node. Here each member node's agent publishes, in the c10d rendezvous' store
(every agent, a spare too, reaches it at ``--rdzv-endpoint``):

- its **seat** (:class:`Seat`), once per round: its group rank, its workers' ranks, the workers'
  store; what another node needs to start the same ranks;
- its **lease**: a record it rewrites every ``BEAT_S`` (a counter and its workers' generation and
  step), and a socket a spare keeps open to it. A killed agent's socket closes at once; a machine
  that vanished stops beating and is seen after the spare's lease time. An agent that ends on
  its own says goodbye on both first.
- its **fence**: a seat a spare claimed (:mod:`resilient.launcher.spare`) is not this node's any
  more. An agent that was cut off and comes back finds its seat claimed and stops its workers:
  two processes never hold one rank.

Keys live under ``resilient.nodes.<rdzv id>``, apart from torch's.
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

from loguru import logger

from resilient.launch_env import local_address

BEAT_S = 0.25  # how often a member rewrites its lease
BYE = b"bye\n"  # what a member's agent sends a spare before it ends on its own


def store_endpoint(backend: str, endpoint: str | None) -> tuple[str, int] | None:
    """Where the c10d rendezvous' store listens, (host, port); None for another backend or a port
    chosen at start (a single-node ``--standalone`` job: nothing can join it)."""
    if backend != "c10d" or not endpoint:
        return None
    host, sep, port = endpoint.rpartition(":")
    if not sep:
        host, port = endpoint, "29400"  # (torch's c10d default)
    if not port.isdigit() or int(port) == 0:
        return None
    return host.strip("[]"), int(port)


def connect(where: tuple[str, int], timeout_s: float = 10.0) -> Any:
    """A client of the rendezvous' store."""
    import torch.distributed as dist

    host, port = where
    timeout = timedelta(seconds=timeout_s)
    return dist.TCPStore(host, port, None, False, timeout=timeout, wait_for_workers=False)


class Keys:
    """The names of a job's node keys (``rdzv_id``: the rendezvous id every node was given)."""

    def __init__(self, rdzv_id: str) -> None:
        self.base = f"resilient.nodes.{rdzv_id}"

    def round(self) -> str:
        return f"{self.base}/round"  # the newest round whose seats are published

    def seat(self, round_no: int, group_rank: int) -> str:
        return f"{self.base}/r{round_no}/seat/{group_rank}"

    def lease(self, round_no: int, group_rank: int) -> str:
        return f"{self.base}/r{round_no}/lease/{group_rank}"

    def claim(self, round_no: int, group_rank: int) -> str:
        return f"{self.base}/r{round_no}/claim/{group_rank}"

    def arrived(self) -> str:
        return f"{self.base}/arrived"  # nodes counted as they came, before any round ran

    def spares(self) -> str:
        return f"{self.base}/spares"  # how many spares park (added to as they come and go)


@dataclass(frozen=True)
class Seat:
    """One node's place in a round: enough to start its ranks elsewhere."""

    round: int
    group_rank: int
    group_world_size: int
    master_addr: str  # the workers' store (torch's MASTER_ADDR/PORT)
    master_port: int
    # (local rank, global rank, role rank, world size, role world size) of each worker
    workers: tuple[tuple[int, int, int, int, int], ...]
    host: str  # where its agent's liveness socket listens
    port: int

    def dumps(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def loads(cls, raw: bytes | str) -> Seat:
        d = json.loads(raw)
        return cls(**{**d, "workers": tuple(tuple(w) for w in d["workers"])})


@dataclass(frozen=True)
class Lease:
    """A member's lease as last written: ``n`` counts its beats; ``ranks``: global rank →
    (generation, step) of its workers' last heartbeats; ``bye``: it ended on its own."""

    n: int
    ranks: dict[int, tuple[int, int]]
    bye: bool = False

    def dumps(self) -> str:
        ranks = {str(k): list(v) for k, v in self.ranks.items()}
        return json.dumps({"n": self.n, "ranks": ranks, "bye": self.bye})

    @classmethod
    def loads(cls, raw: bytes | str) -> Lease:
        d = json.loads(raw)
        ranks = {int(k): (int(v[0]), int(v[1])) for k, v in d.get("ranks", {}).items()}
        return cls(int(d["n"]), ranks, bool(d.get("bye", False)))


class SeatHolder:
    """A member node's seat, lease and fence, kept by a daemon thread from :meth:`hold` on.

    ``ranks()``: this node's workers' global rank → (generation, step) (their heartbeats);
    ``on_fenced(claimed_by)``: a spare claimed this node's seat (it was taken for lost); ``me``:
    this node's name in a claim (:func:`resilient.launcher.spare.spare_id`)."""

    def __init__(
        self,
        where: tuple[str, int],
        rdzv_id: str,
        ranks: Callable[[], dict[int, tuple[int, int]]],
        on_fenced: Callable[[str], None],
        me: str,
    ) -> None:
        self.where = where
        self.me = me  # (a spare that took the seat holds it under its claim: not fenced by it)
        self.keys = Keys(rdzv_id)
        self.ranks = ranks
        self.on_fenced = on_fenced
        self.seat: Seat | None = None
        self._store: Any = None
        self._lock = threading.Lock()  # (the store client is the thread's and hold()'s)
        self._listener = socket.create_server(("", 0))
        self._listener.setblocking(False)
        self.host = local_address(where)
        self.port = int(self._listener.getsockname()[1])
        self._peers: list[socket.socket] = []  # spares watching this node
        self._n = 0
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None

    def _client(self) -> Any:
        if self._store is None:
            self._store = connect(self.where)
        return self._store

    def hold(self, seat: Seat) -> None:
        """This node sits at ``seat`` from now on (its workers just started in that round)."""
        with self._lock:
            store = self._client()
            self.seat = seat
            store.set(self.keys.seat(seat.round, seat.group_rank), seat.dumps())
            self._beat(store)
            store.set(self.keys.round(), str(seat.round))  # (every member writes the same)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="resilient-lease", daemon=True)
            self._thread.start()

    def _beat(self, store: Any, bye: bool = False) -> None:
        assert self.seat is not None
        self._n += 1
        lease = Lease(self._n, self.ranks(), bye)
        store.set(self.keys.lease(self.seat.round, self.seat.group_rank), lease.dumps())

    def _run(self) -> None:
        fenced = False
        while not self._halt.wait(0 if self._accept() else BEAT_S):
            try:
                with self._lock:
                    store = self._client()
                    self._beat(store)
                    seat = self.seat
                    assert seat is not None
                    key = self.keys.claim(seat.round, seat.group_rank)
                    claimed = store.get(key).decode() if store.check([key]) else None
            except Exception as e:  # the store's host may be the node that was lost
                logger.debug("lease: {}", e)
                with self._lock:
                    self._store = None
                continue
            if claimed and claimed != self.me and not fenced:
                fenced = True
                self.on_fenced(claimed)

    def _accept(self) -> bool:
        """Take the spares' connections waiting (True: one came, look again at once)."""
        try:
            ready, _, _ = select.select([self._listener], [], [], 0)
        except (ValueError, OSError):  # (closed by close() after its join gave up, under load)
            return False
        if not ready:
            return False
        with contextlib.suppress(OSError):
            conn, _ = self._listener.accept()
            self._peers.append(conn)
        return True

    def close(self, bye: bool = True) -> None:
        """Stop beating; ``bye``: this node ends on its own (its spares must not take its seat)."""
        self._halt.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        if bye and self.seat is not None:
            with contextlib.suppress(Exception), self._lock:
                self._beat(self._client(), bye=True)
        for conn in self._peers:
            with contextlib.suppress(OSError):
                if bye:
                    conn.sendall(BYE)
                conn.close()
        self._peers.clear()
        self._listener.close()
