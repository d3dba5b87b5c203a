"""The launcher's seam to what runs its workers: :class:`WorkerBackend`.

What the agent decides about a death (:mod:`resilient.launcher.policy`) and how it carries that
out (:mod:`resilient.launcher.supervisor`: who died or went silent, the group restarted or
stopped; :mod:`resilient.launcher.replace`: a new process in one dead rank's place) asks a backend
for this node's workers and their processes, and reaches nothing else of the machinery that runs
them. torch elastic's agent is one backend (:class:`resilient.launcher.elastic.Elastic`); an
in-memory fake in a unit test is another (``tests/unit/test_launch_backend.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from resilient.contract import KeyStore


@dataclass(frozen=True)
class Slot:
    """One worker of this node as the backend runs it now."""

    local_rank: int
    global_rank: int
    pid: int | None  # its process (None: none of its own yet)


@dataclass(frozen=True)
class Invocation:
    """How the backend starts ``local_rank``'s worker: what its replacement, or a standby that
    takes its place, runs as."""

    entrypoint: str
    args: tuple[str, ...]
    env: dict[str, str]  # what the backend gives the worker (its rank, the store), beside the launcher's own
    stdout: str | None  # where its output goes (None: the launcher's own)
    stderr: str | None


class Process(Protocol):
    """A worker's process as the backend holds it (torch's ``SubprocessHandler``, a promoted
    standby): ``proc`` is its ``Popen``."""

    proc: Any


class WorkerBackend(Protocol):
    """This node's workers, as the launcher's decisions and replacements need them."""

    def workers(self) -> list[Slot]:
        """This node's workers now, in local rank order (none before they start)."""
        ...

    def exited(self) -> list[tuple[int, int]]:
        """(local rank, exit code) of the workers that ended with an error since the last look
        (negative: killed by that signal)."""
        ...

    def processes(self) -> bool:
        """The workers are processes of their own, which can be replaced one at a time."""
        ...

    def invocation(self, local_rank: int) -> Invocation: ...

    def spawn(self, local_rank: int, env: dict[str, str]) -> Process:
        """A new process for ``local_rank`` with ``env``, started as the backend starts one; not
        the rank's until :meth:`adopt`."""
        ...

    def adopt(self, local_rank: int, new: Process) -> None:
        """``new`` is ``local_rank``'s process from now on (monitored, signalled and stopped as
        the backend's own); its dead predecessor is let go."""
        ...

    def kill(self, local_rank: int) -> None:
        """SIGKILL ``local_rank``'s process and what it left in its session (a stopped process, or
        one that holds the GIL, never handles SIGTERM); nothing where it is gone."""
        ...

    def connect_store(self) -> KeyStore:
        """A connection to the workers' store, where a dead rank's fault is posted."""
        ...

    def restart_group(self, reason: str | None) -> None:
        """Every worker of the group is to be stopped and started again (``reason``: why not
        one rank alone)."""
        ...

    def stop_group(self, reason: str | None) -> None:
        """Every worker of the group is to be stopped, and none started again: the launcher ends."""
        ...
