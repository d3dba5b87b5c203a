"""Process-group lifecycle: build a group on a fresh store generation, abort it, tear it down.

gloo has no working abort (pytorch#130345): ``abort()``, ``shutdown()`` and
``destroy_process_group()`` return at once but leave the peer connections open, so a peer blocked
in a collective waits for the full timeout. We record the TCP connections gloo opens while the
group is created and, to abort, ``shutdown(SHUT_RDWR)`` them: the local blocked collective and every
peer's collective fail at once with "Connection closed by peer". Listening sockets are left alone
(shutting down gloo's listener crashes its accept loop) and so are connections to the store.

NCCL is aborted with ``_abort_process_group`` (it unblocks pending collectives from another thread);
``TORCH_NCCL_ASYNC_ERROR_HANDLING`` must not kill the process on error, see :func:`nccl_env`.

torch's own gloo ``abort()`` (2.13+) still leaves a blocked collective blocked, here and on the
peer, through 2.15; its in-place ``_reconfigure`` (2.14+) rebuilds a group ~7 ms faster but
only among processes that all hold the old group, so a replacement could not join it, and the
default group would stay on the old generation's store (``benchmarks/gloo_core_paths.py``,
docs/recovery.md). Each generation's group is therefore built anew; :data:`PATHS` says how, in
the ``group_rebuilt`` event.
"""

from __future__ import annotations

import functools
import os
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from loguru import logger

from resilient.detectors import p2p


def resolve_backend(backend: str) -> str:
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    return backend


def nccl_env(environ: dict[str, str] | os._Environ[str] = os.environ) -> dict[str, str]:
    """Set the NCCL variables in-process recovery needs (unless the user set them); return them.

    - ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (CleanUpOnly): abort communicators on error without
      killing the process; the default (3) ends the process, which defeats in-process restart.
    - ``TORCH_NCCL_RETHROW_CUDA_ERRORS=0``: surface CUDA errors to the step instead of the watchdog.
    """
    wanted = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0"}
    for k, v in wanted.items():
        if k not in environ:
            environ[k] = v
    return {k: environ[k] for k in wanted}


def _socket_inodes() -> dict[int, str]:
    out: dict[int, str] = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:"):
            out[int(fd)] = link
    return out


# how a group is aborted (by backend) and rebuilt: the ``group_rebuilt`` event's fields
PATHS = {
    "gloo": {"abort": "sockets", "rebuild": "init_process_group"},
    "nccl": {"abort": "nccl_abort", "rebuild": "init_process_group"},
}


@dataclass
class Group:
    """A default process group built by the runtime for one generation."""

    backend: str
    generation: int
    store_port: int
    _sockets: dict[int, str] = field(default_factory=dict)
    _aborted: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def abort(self) -> int:
        """Make every pending collective of this group fail now, on this rank and its peers.

        Safe to call from a thread other than the one blocked in the collective; idempotent.
        Returns the number of connections shut down (gloo) or 1 (NCCL abort).
        """
        with self._lock:
            if self._aborted:
                return 0
            self._aborted = True
        p2p.refuse(f"generation {self.generation}'s group was aborted")  # (before its connections go)
        if self.backend == "nccl":
            try:
                dist.distributed_c10d._abort_process_group()
            except Exception as e:  # already destroyed, or an old torch
                logger.warning("NCCL abort failed: {}", e)
                return 0
            return 1
        return self._shutdown_gloo_connections()

    def _shutdown_gloo_connections(self) -> int:
        n = 0
        for fd, inode in self._sockets.items():
            try:
                if os.readlink(f"/proc/self/fd/{fd}") != inode:
                    continue  # closed, and the number reused by something else
                s = socket.socket(fileno=fd)
            except OSError:
                continue  # closed meanwhile by gloo's own threads
            try:
                if s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    continue
                try:
                    ports = (s.getpeername()[1], s.getsockname()[1])
                except OSError:
                    continue  # not connected
                if self.store_port in ports or _store_ports.intersection(ports):
                    continue  # a store connection (ours, or a peer's accepted by the server we host)
                s.shutdown(socket.SHUT_RDWR)
                n += 1
            except OSError:
                pass
            finally:
                s.detach()  # the descriptor stays gloo's to close
        return n

    def destroy(self, abort: bool = True) -> None:
        """Tear the group down after the main thread left every collective (idempotent).

        ``abort`` first when peers may still be blocked in a collective of this group.
        """
        global _current
        if _current is self:
            _current = None
        if abort:
            self.abort()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as e:
                logger.warning("destroy_process_group failed after abort: {}", e)
        p2p.accept()  # (the aborted group's ops are gone with it)


def group_paths(group: Any) -> dict[str, str]:
    """How ``group`` is aborted and rebuilt (:data:`PATHS`, by its backend)."""
    return PATHS.get(getattr(group, "backend", "gloo"), PATHS["gloo"])


class GroupOwner:
    """The one owner of the generation's process group: it builds it, aborts it (from any thread:
    a listener, the monitor, an engine's abort hook) and ends it; everything else asks it. After an
    abort the group refuses new point-to-point work (:meth:`Group.abort`) until the next is built."""

    def __init__(self, build: Callable[[int], Group]) -> None:
        self._build = build
        self._group: Group | None = None

    @property
    def current(self) -> Group | None:
        return self._group

    def build(self, generation: int) -> None:
        """``generation``'s group; one that fails to build leaves none."""
        self._group = None
        self._group = self._build(generation)

    def abort(self, generation: int | None = None) -> int:
        """(any thread) Every pending collective of ``generation``'s group (the current one:
        ``None``) fails now, here and on the peers; an older generation's abort does nothing.
        The connections shut down (gloo), 1 (NCCL), or 0 (none, or aborted already)."""
        group = self._group  # (the main thread may end it concurrently)
        if group is None or (generation is not None and group.generation != generation):
            return 0
        return group.abort()

    def end(self) -> int:
        """(the main thread, after it left every collective) Aborted, destroyed and gone: what the
        abort shut down, or 0."""
        group, self._group = self._group, None
        if group is None:  # (never built, or a finished engine's)
            return 0
        n = group.abort()
        group.destroy()
        return n

    def close(self) -> None:
        """The run finished: destroyed without an abort (every rank left every collective)."""
        group, self._group = self._group, None
        if group is not None:
            group.destroy(abort=False)

    def forget(self) -> None:
        """Destroyed by someone else (NVRx's abort): only the reference goes."""
        self._group = None


_current: Group | None = None  # the generation's group: process groups created meanwhile are its too
_store_ports: set[int] = set()  # other stores' ports (NVRx's): their connections are never shut down


def protect_store_port(port: int) -> None:
    """Connections to or from ``port`` belong to a store, never to a group: an abort leaves them
    (a store client opened by another thread while a group is built would otherwise look like
    one of the group's connections)."""
    _store_ports.add(port)


def _record_subgroups() -> None:
    """Have every process group created while a generation's group stands (a ``DeviceMesh``'s
    dimensions, your own ``new_group``) record the connections it opens into that group: an abort
    must reach a collective blocked on any of them, not only on the default group."""
    c10d = dist.distributed_c10d
    create = c10d._new_process_group_helper
    if getattr(create, "_resilient", False):
        return

    @functools.wraps(create)
    def recording(*args: Any, **kwargs: Any) -> Any:
        group = _current
        before = _socket_inodes() if group is not None and group.backend == "gloo" else None
        try:
            return create(*args, **kwargs)
        finally:
            if group is not None and before is not None:
                after = _socket_inodes()
                group._sockets.update({fd: ino for fd, ino in after.items() if before.get(fd) != ino})

    recording._resilient = True  # type: ignore[attr-defined]
    c10d._new_process_group_helper = recording


def build_group(
    *,
    backend: str,
    store: dist.Store,
    store_port: int,
    rank: int,
    world_size: int,
    generation: int,
    timeout: float,
    device_id: torch.device | None = None,
    namespace: str = "",
) -> Group:
    """Create the default process group on ``PrefixStore(<namespace>/g<generation>/pg, store)``.

    The namespace carries the launch attempt: after a relaunch the agent's store still holds the
    dead workers' gloo addresses under the previous attempt's keys."""
    if backend == "nccl":
        nccl_env()
    p2p.hold()
    p2p.accept()
    before = _socket_inodes()
    # init_process_group wraps sys.excepthook (rank prefix, stderr captured in a StringIO) every
    # time it runs: after N in-process restarts every line would carry N prefixes, and a hook that
    # ends the process would print into the StringIO. Keep the hook the process had.
    hook = sys.excepthook
    prefixed = dist.PrefixStore(f"{namespace}/g{generation}/pg", store)
    kwargs: dict[str, object] = {}
    if device_id is not None and backend == "nccl":
        kwargs["device_id"] = device_id
    dist.init_process_group(
        backend,
        store=prefixed,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout),
        **kwargs,  # type: ignore[arg-type]
    )
    sys.excepthook = hook
    after = _socket_inodes()
    new = {fd: ino for fd, ino in after.items() if before.get(fd) != ino}
    global _current
    _current = Group(backend=backend, generation=generation, store_port=store_port, _sockets=new)
    _record_subgroups()
    return _current
