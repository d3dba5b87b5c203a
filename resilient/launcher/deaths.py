"""A worker's death seen when the kernel reports it, not at the agent's next poll.

torch's agent loop sleeps ``monitor_interval`` (0.1 s under ``resilient launch``) between two looks
at its workers, so a death waited 0.05 s on average before anything acted on it. :class:`DeathWatch`
holds a pidfd (Linux 5.3+) of every worker and standby process and wakes the loop's sleep the
moment one becomes readable (the process exited): the loop stands in a :class:`WakeableTime` for
the ``time`` module it sleeps with. Without pidfds (an older kernel, another OS) nothing changes:
the loop polls as before.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
import time
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

from loguru import logger


class WakeableTime:
    """The ``time`` module, but ``sleep`` ends early when :meth:`wake` is called, or when the
    ``deadline`` (a ``time.monotonic()`` instant, if any is set and still ahead) comes first: a
    worker's heartbeat limit is acted on when it runs out, not at the next poll."""

    def __init__(self, real: ModuleType = time) -> None:
        self._real = real
        self._event = threading.Event()
        self.deadline: Callable[[], float | None] | None = None

    def sleep(self, seconds: float) -> None:
        if self.deadline is not None:
            due = self.deadline()
            now = self._real.monotonic()
            if due is not None and due > now:  # (one already passed is the poll's to act on)
                seconds = min(seconds, due - now)
        self._event.wait(seconds)
        self._event.clear()

    def wake(self) -> None:
        self._event.set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class DeathWatch:
    """A daemon thread: ``pids()`` says which processes to watch (read again every ``refresh_s``,
    so a replacement is watched from then on); ``on_death()`` is called when one exits."""

    def __init__(
        self, pids: Callable[[], Iterable[int]], on_death: Callable[[], None], refresh_s: float = 0.2
    ) -> None:
        self.pids = pids
        self.on_death = on_death
        self.refresh_s = refresh_s
        self._fds: dict[int, int] = {}  # pid -> its pidfd
        self.synced = threading.Event()  # set once the processes ``pids()`` named are watched
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def available() -> bool:
        return hasattr(os, "pidfd_open") and hasattr(select, "poll")

    def start(self) -> bool:
        """Start watching; False where pidfds are not available (the agent then polls)."""
        if not self.available():
            return False
        try:
            os.close(os.pidfd_open(os.getpid()))
        except OSError as e:  # (a kernel before 5.3)
            logger.debug("no pidfd ({}): worker deaths are seen at the agent's poll", e)
            return False
        self._thread = threading.Thread(target=self._run, name="resilient-deaths", daemon=True)
        self._thread.start()
        return True

    def _sync(self) -> None:
        want = set(self.pids())
        for pid in set(self._fds) - want:
            os.close(self._fds.pop(pid))
        for pid in want - set(self._fds):
            try:
                self._fds[pid] = os.pidfd_open(pid)
            except OSError:  # exited already: the agent's own poll sees it
                continue

    def _run(self) -> None:
        while not self._halt.is_set():
            try:
                self._sync()
                self.synced.set()
                poller = select.poll()
                for fd in self._fds.values():
                    poller.register(fd, select.POLLIN)
                ready = poller.poll(self.refresh_s * 1e3)
            except Exception as e:  # (the watch is an optimisation: the agent polls anyway)
                logger.debug("death watch: {}", e)
                self._halt.wait(self.refresh_s)
                continue
            if ready:
                gone = {fd for fd, _ in ready}
                for pid in [p for p, fd in self._fds.items() if fd in gone]:
                    os.close(self._fds.pop(pid))
                self.on_death()

    def close(self) -> None:
        self._halt.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None
        for fd in self._fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()
