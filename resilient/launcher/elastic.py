"""torch elastic as the launcher's :class:`~resilient.launcher.backend.WorkerBackend`, and the one
door into its private state.

``resilient launch`` extends torch's ``LocalElasticAgent`` and its c10d rendezvous in ways their
public API does not offer: replace one worker's process, bound restarts over a window, count the
waiting nodes its own way, leave a rendezvous without closing it. Every private attribute, method
or function of torch that this needs is reached here and nowhere else, so a torch upgrade that
renames one breaks one class, and :data:`PRIVATE` (checked against the installed torch by
``tests/unit/test_launch_policy.py``) says which names to look for.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from loguru import logger

from resilient.contract import KeyStore
from resilient.launcher.backend import Invocation, Process, Slot

# (where, name): every private name of torch this module reaches (torch 2.13).
PRIVATE: tuple[tuple[str, str], ...] = (
    ("torch.distributed.elastic.agent.server.api:SimpleElasticAgent", "_remaining_restarts"),
    ("torch.distributed.elastic.agent.server.local_elastic_agent:LocalElasticAgent", "_pcontext"),
    ("torch.distributed.elastic.multiprocessing.api:SubprocessContext", "_running_local_ranks"),
    ("torch.distributed.elastic.multiprocessing.api:SubprocessContext", "subprocess_handlers"),
    ("torch.distributed.elastic.multiprocessing.subprocess_handler:SubprocessHandler", "_stdout"),
    ("torch.distributed.elastic.multiprocessing.subprocess_handler:SubprocessHandler", "_stderr"),
    ("torch.distributed.elastic.rendezvous.dynamic_rendezvous:DynamicRendezvousHandler", "_state_holder"),
    ("torch.distributed.elastic.rendezvous.dynamic_rendezvous:DynamicRendezvousHandler", "_op_executor"),
    ("torch.distributed.elastic.rendezvous.dynamic_rendezvous:DynamicRendezvousHandler", "_stop_heartbeats"),
    ("torch.distributed.elastic.rendezvous.dynamic_rendezvous:_RendezvousState", "round"),
    ("torch.distributed.elastic.rendezvous.dynamic_rendezvous:_RendezvousState", "participants"),
    ("torch.distributed.elastic.rendezvous.dynamic_rendezvous:_RendezvousState", "wait_list"),
    ("torch.distributed.elastic.rendezvous.dynamic_rendezvous:_RendezvousState", "closed"),
    ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_RendezvousExitOp"),
    ("torch.distributed.launcher.api", "_get_addr_and_port"),
    ("torch.distributed.elastic.multiprocessing.api", "get_subprocess_handler"),
    ("torch.distributed.elastic.agent.server.api:SimpleElasticAgent", "_store"),
)

_UNBOUNDED = 1 << 30


def _reap(proc: Any) -> None:
    """Wait for a dead worker's process (no zombie is left; bounded: it was SIGKILLed)."""
    with contextlib.suppress(Exception):
        proc.wait(timeout=30)


@dataclass(frozen=True)
class RendezvousView:
    """The c10d rendezvous as this node last synced it (node descriptors are opaque)."""

    round: int | None
    participants: frozenset[Any]  # the nodes of the running round
    wait_list: frozenset[Any]  # nodes waiting for the next round
    closed: bool
    ranks: dict[Any, int] = field(default_factory=dict)  # each participant's group rank


class Elastic:
    """torch elastic's agent, its workers' processes and its rendezvous handler, as the launcher
    needs them. Built around a started-or-not ``LocalElasticAgent``; reads through to it."""

    def __init__(self, agent: Any) -> None:
        self._agent = agent
        self.group_reason: str | None = None  # why the group stops next (its group_stopped event)

    @property
    def _spec(self) -> Any:
        return self._agent.get_worker_group().spec

    @property
    def _pc(self) -> Any:
        return self._agent._pcontext

    # ---- the restart count torch keeps (TORCHELASTIC_RESTART_COUNT is derived from it) ----------
    @property
    def restarts_left(self) -> int:
        return int(self._agent._remaining_restarts)

    @restarts_left.setter
    def restarts_left(self, n: int) -> None:
        self._agent._remaining_restarts = n

    def unbound_restarts(self) -> None:
        """torch stops restarting only when told (``restarts_left = 0``); its restart count still
        counts up from 0 for the workers' ``TORCHELASTIC_RESTART_COUNT``."""
        self._spec.max_restarts = self._agent._remaining_restarts = _UNBOUNDED

    # ---- the group ---------------------------------------------------------------------------------
    def workers(self) -> list[Slot]:
        return [
            Slot(w.local_rank, w.global_rank, w.id if isinstance(w.id, int) else None)
            for w in self._agent.get_worker_group().workers
        ]

    def restart_group(self, reason: str | None) -> None:
        """torch's loop restarts the group on the round's failed result (its restarts are unbound)."""
        self.group_reason = reason

    def stop_group(self, reason: str | None) -> None:
        """torch's loop stops the workers and returns on the round's failed result."""
        self.group_reason = reason
        self.restarts_left = 0

    # ---- the workers' processes (torch's SubprocessContext) --------------------------------------
    def processes(self) -> bool:
        """The workers run as subprocesses whose handlers can be swapped (``resilient launch``
        always starts a binary; a function entry point runs under multiprocessing instead)."""
        return hasattr(self._pc, "subprocess_handlers")

    def exited(self) -> list[tuple[int, int]]:
        """(local rank, exit code) of the running workers that ended with an error since torch last
        polled, in local rank order (negative: killed by that signal)."""
        pc = self._pc
        out = []
        for local_rank in sorted(pc._running_local_ranks):
            code = pc.subprocess_handlers[local_rank].proc.poll()
            if code is not None and code != 0:
                out.append((local_rank, code))
        return out

    def pids(self) -> list[int]:
        """The pids of this node's worker processes (none before they start)."""
        pc = getattr(self._agent, "_pcontext", None)
        handlers = getattr(pc, "subprocess_handlers", None) or {}
        return [h.proc.pid for h in handlers.values()]

    def process(self, local_rank: int) -> Any:
        """The handler of ``local_rank``'s process (``proc`` is its ``Popen``)."""
        return self._pc.subprocess_handlers.get(local_rank)

    def env(self, local_rank: int) -> dict[str, str]:
        """The environment torch gave ``local_rank``'s worker (``RANK``, the store, ...)."""
        return dict(self._pc.envs[local_rank])

    def local_ranks(self) -> list[int]:
        """This node's workers' local ranks."""
        return sorted(self._pc.envs)

    def command(self, local_rank: int) -> tuple[str, tuple[str, ...]]:
        return str(self._spec.entrypoint), tuple(self._pc.args[local_rank])

    def outputs(self, local_rank: int) -> tuple[str | None, str | None]:
        """Where ``local_rank``'s stdout and stderr go (None: the agent's own)."""
        pc = self._pc
        return pc.stdouts.get(local_rank) or None, pc.stderrs.get(local_rank) or None

    def invocation(self, local_rank: int) -> Invocation:
        entrypoint, args = self.command(local_rank)
        return Invocation(entrypoint, args, self.env(local_rank), *self.outputs(local_rank))

    def spawn(self, local_rank: int, env: dict[str, str]) -> Any:
        """A new process for ``local_rank`` as torch starts one (its session, its output files)."""
        from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

        entrypoint, args = self.command(local_rank)
        stdout, stderr = self.outputs(local_rank)
        return SubprocessHandler(
            entrypoint=entrypoint,
            args=args,
            env=env,
            stdout=stdout,
            stderr=stderr,
            local_rank_id=local_rank,
            numa_options=None,
        )

    def swap(self, local_rank: int, new: Any) -> None:
        """``new`` is ``local_rank``'s process from now on: torch monitors, signals and stops it.
        The old handler's output files are closed (its process is dead)."""
        pc = self._pc
        old = pc.subprocess_handlers.get(local_rank)
        with contextlib.suppress(Exception):
            for f in (getattr(old, "_stdout", None), getattr(old, "_stderr", None)):
                if f is not None:
                    f.close()
        pc.subprocess_handlers[local_rank] = new

    def adopt(self, local_rank: int, new: Process) -> None:
        """``new`` is ``local_rank``'s process from now on (:meth:`swap`, its worker's ``id``);
        its predecessor is reaped in the background. A replacement is a restart for
        ``TORCHELASTIC_RESTART_COUNT``."""
        old = self.process(local_rank)
        self.swap(local_rank, new)
        for w in self._agent.get_worker_group().workers:
            if w.local_rank == local_rank:
                w.id = new.proc.pid
        self.restarts_left -= 1
        threading.Thread(target=_reap, args=(old.proc,), name="resilient-reap", daemon=True).start()

    def kill(self, local_rank: int) -> None:
        pid = next((w.pid for w in self.workers() if w.local_rank == local_rank), None)
        if pid is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            try:  # torch starts each worker in a session of its own: its group is its pid, reaped or not
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:  # no such group: a worker in the agent's own (multiprocessing's)
                os.kill(pid, signal.SIGKILL)

    def connect_store(self) -> KeyStore:
        """A connection to the workers' store (torch's ``MASTER_ADDR``/``MASTER_PORT``: the agent's
        store, or rank 0's), where the runtime's keys are."""
        from datetime import timedelta

        import torch.distributed as dist

        env = self.env(self.local_ranks()[0])
        host, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
        return dist.TCPStore(host, port, None, False, timeout=timedelta(seconds=10), wait_for_workers=False)

    @contextlib.contextmanager
    def handlers(self, make: Callable[..., Any]) -> Iterator[None]:
        """While in this block, torch starts each worker's process with ``make(**its arguments)``
        (a spare promotes its standbys there) instead of its own ``get_subprocess_handler``."""
        from torch.distributed.elastic.multiprocessing import api as mp_api

        real = mp_api.get_subprocess_handler
        mp_api.get_subprocess_handler = lambda **kw: make(real, **kw)
        try:
            yield
        finally:
            mp_api.get_subprocess_handler = real

    # ---- the rendezvous (c10d's DynamicRendezvousHandler) ----------------------------------------
    def take_seat(self, worker_group: Any, seat: Any, raw_store: Any) -> None:
        """``worker_group`` holds ``seat`` (a lost node's, :mod:`resilient.launcher.spare`) as torch's
        rendezvous would have assigned it: its workers, the round's store (where torch's exit
        barrier counts the nodes), the workers' store address."""
        import torch.distributed as dist

        from resilient.launcher.spare import seat_workers

        prefix = f"torch.rendezvous.{self._handler.get_run_id()}.{seat.round}"  # (torch's, per round)
        store = dist.PrefixStore(prefix, raw_store)
        worker_group.workers = seat_workers(seat)
        worker_group.store = store
        worker_group.group_rank = seat.group_rank
        worker_group.group_world_size = seat.group_world_size
        worker_group.master_addr = seat.master_addr
        worker_group.master_port = seat.master_port
        self._agent._store = store

    def sync_rendezvous(self) -> RendezvousView | None:
        """The rendezvous state read from its store now (a node outside the round has none)."""
        with contextlib.suppress(Exception):
            self._handler.num_nodes_waiting()
        return self.rendezvous()

    @property
    def _handler(self) -> Any:
        return self._spec.rdzv_handler

    def rendezvous(self) -> RendezvousView | None:
        """The rendezvous state as last synced; None for a handler without one (static, etcd)."""
        state = getattr(getattr(self._handler, "_state_holder", None), "state", None)
        if state is None:
            return None
        round_no = getattr(state, "round", None)
        return RendezvousView(
            round=round_no if isinstance(round_no, int) else None,
            participants=frozenset(getattr(state, "participants", ())),
            wait_list=frozenset(getattr(state, "wait_list", ())),
            closed=bool(getattr(state, "closed", False)),
            ranks=dict(getattr(state, "participants", {}) or {}),
        )

    def count_waiting(self, count: Callable[[int, RendezvousView | None], int]) -> None:
        """torch's agent restarts a healthy group when ``num_nodes_waiting() > 0``: from now on
        ``count(torch's number, the state that call just synced)`` says how many wait."""
        handler = self._handler
        waiting = handler.num_nodes_waiting

        def num_nodes_waiting() -> int:
            n = int(waiting())  # syncs the rendezvous state, dropping nodes whose keep-alive expired
            return count(n, self.rendezvous())

        handler.num_nodes_waiting = num_nodes_waiting

    def publish_store_address(self) -> None:
        """torch (2.13) re-uses node 0's cached store address in later rounds without writing it to
        the new round's keys, so a node joining in a later round (a spare, a replacement) waits
        for ``MASTER_ADDR`` until it times out. Group rank 0 writes it for every round."""
        handler = self._handler
        nxt = handler.next_rendezvous

        def next_rendezvous() -> Any:
            info = nxt()
            boot = getattr(info, "bootstrap_store_info", None)
            if info.rank == 0 and boot is not None:
                from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo as Info

                info.store.set(Info.MASTER_ADDR_KEY, boot.master_addr)
                info.store.set(Info.MASTER_PORT_KEY, str(boot.master_port))
            return info

        handler.next_rendezvous = next_rendezvous

    def leave_rendezvous(self) -> None:
        """Leave the rendezvous without closing it (``shutdown()`` would end it for every node)."""
        handler = self._handler
        try:
            from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousExitOp

            handler._stop_heartbeats()
            handler._op_executor.run(_RendezvousExitOp(), time.monotonic() + 30)
        except Exception as e:  # private API: the keep-alive expiry removes this node anyway
            logger.warning(
                f"could not leave the rendezvous at once ({e}); peers drop it at keep-alive expiry"
            )

    @staticmethod
    def master_address(rdzv: Any) -> tuple[str | None, int | None]:
        """torchrun's ``MASTER_ADDR``/``MASTER_PORT`` for a static rendezvous (None otherwise)."""
        from torch.distributed.launcher.api import _get_addr_and_port

        return _get_addr_and_port(rdzv)
