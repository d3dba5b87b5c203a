"""Point-to-point traffic counted per peer and direction, for the collective count (:mod:`.collectives`).

A pipeline's stages send activations forward and gradients back (``send``/``recv``,
``isend``/``irecv``, ``batch_isend_irecv``). gloo counts each of them in the group's sequence
number like a collective, so a middle stage, which sends and receives twice as often as an end
stage, looked desynchronized to the collective count; on a ``pp`` x ``dp`` mesh they run on a
subgroup, which the count never saw. Each of them reaches the backend through one of three
methods of ``ProcessGroup`` (``send``, ``recv``, ``recv_anysource``), whichever Python function
issued it; those are wrapped on the class, for every group (the Python functions cannot be:
``P2POp`` holds the function it was given and ``batch_isend_irecv`` asks ``op is isend``). Each op
is counted by its peer's global rank and its direction, and what it added to the default group's
sequence number (gloo: one; NCCL counts point-to-point apart) is taken out of the collective count.

The collective count then posts, with its count, what this rank sent to and received from each
peer in the window (``>3=12 <3=12``), and compares with each peer's post: what rank ``i`` sent to
``j`` must be what ``j`` received from ``i``. A stage that skips a send is a desync naming both
ranks. In a pipeline a skipped send leaves its receiver blocked (and, one schedule later, the
sender too), so it is usually found at a hang: :func:`diagnose_hang` tells a deadlock (two ranks, both
blocked, each having posted receives the other never matched) from a peer that is merely late.

The same wrapper refuses an op on a group the runtime aborted (:func:`refuse`, from the group's
abort, until the group is gone): one posted while the connections are being shut could miss it.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch.distributed as dist

from resilient.errors import StepInterrupted

SENT, RECEIVED = ">", "<"  # a key's first character: ``>3`` ops sent to rank 3, ``<3`` received from it


class Tally:
    """What this process issued point to point: ops by direction and peer (``>3``, ``<3``), and
    how many sequence numbers of the default group they took (that group's, while it lives)."""

    def __init__(self) -> None:
        self.ops: Counter[str] = Counter()
        self._default: weakref.ref[Any] | None = None
        self._taken = 0

    def count(self, direction: str, peer: int, n: int = 1) -> None:
        self.ops[f"{direction}{peer}"] += n

    def took(self, group: Any, n: int) -> None:
        """``n`` sequence numbers of ``group`` (the default group) went to point-to-point ops."""
        if self._default is None or self._default() is not group:  # a new generation's group
            self._default, self._taken = weakref.ref(group), 0
        self._taken += n

    def taken(self, group: Any) -> int:
        return self._taken if self._default is not None and self._default() is group else 0

    def snapshot(self) -> Counter[str]:
        return Counter(self.ops)

    def since(self, base: Mapping[str, int]) -> dict[str, int]:
        """Ops issued since ``base`` (a :meth:`snapshot`), nonzero only."""
        return {k: n - base.get(k, 0) for k, n in self.ops.items() if n != base.get(k, 0)}


TALLY = Tally()  # this process's: the ProcessGroup methods are wrapped once per process

_lock = threading.Lock()
_installed: list[dict[str, Callable[..., Any]]] = []  # the originals, while installed
_users = 0
_held = False
_refused: weakref.WeakSet[Any] = weakref.WeakSet()  # the aborted generation's groups
_refused_why = [""]
_inverse: weakref.WeakKeyDictionary[Any, dict[int, int]] = weakref.WeakKeyDictionary()


def install() -> None:
    """Count every point-to-point op from now on (idempotent; one :func:`uninstall` per call)."""
    global _users
    with _lock:
        _users += 1
        if _installed:
            return
        pg = dist.ProcessGroup
        originals = {name: getattr(pg, name) for name in ("send", "recv", "recv_anysource")}
        setattr(pg, "send", _counted(originals["send"], SENT))  # noqa: B010 (a pybind class)
        setattr(pg, "recv", _counted(originals["recv"], RECEIVED))  # noqa: B010
        setattr(pg, "recv_anysource", _counted(originals["recv_anysource"], None))  # noqa: B010
        _installed.append(originals)


def hold() -> None:
    """Installed for the rest of the process, once (the runtime's abort refuses posts through it)."""
    global _held
    if not _held:
        _held = True
        install()


def refuse(reason: str) -> None:
    """From now on a point-to-point op on any group that exists now raises
    :class:`StepInterrupted` instead of being posted: a schedule posts sends and receives back to
    back, and one posted while an aborted group's connections are being shut can miss the
    shutdown and wait for good (a gloo receive did)."""
    for group in list(dist.distributed_c10d._world.pg_map):
        if isinstance(group, dist.ProcessGroup):  # (not every key is one)
            _refused.add(group)
    _refused_why[0] = reason


def accept() -> None:
    """The aborted groups are gone: a new generation's are posted to."""
    _refused.clear()


def uninstall() -> None:
    global _users
    with _lock:
        _users = max(0, _users - 1)
        if _users or not _installed:
            return
        for name, fn in _installed.pop().items():
            setattr(dist.ProcessGroup, name, fn)


def _counted(method: Callable[..., Any], direction: str | None) -> Callable[..., Any]:
    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self in _refused:
            raise StepInterrupted(f"point-to-point op not posted: {_refused_why[0]}")
        default = _default_group()
        before = _sequence(self) if self is default else None
        try:
            work = method(self, *args, **kwargs)
        finally:
            after = _sequence(self) if before is not None else None
            if before is not None and after is not None:
                TALLY.took(self, after - before)
        if direction is not None:  # (recv_anysource: no peer to compare with)
            peer: Any = args[1] if len(args) > 1 else kwargs.get("dstRank", kwargs.get("srcRank"))
            g = _global_rank(self, default, int(peer))
            if g is not None:
                TALLY.count(direction, g)
        return work

    counted.__doc__ = method.__doc__
    return counted


def _sequence(group: Any) -> int | None:
    try:
        return int(group._get_sequence_number_for_group())
    except RuntimeError:  # a backend that does not count ("does not yet support sequence numbers")
        return None


def _default_group() -> Any:
    try:
        return dist.distributed_c10d._world.default_pg
    except (AttributeError, RuntimeError, ValueError):
        return None


def _global_rank(group: Any, default: Any, rank: int) -> int | None:
    """``rank`` of ``group`` as a rank of the job (None: a group torch.distributed does not know)."""
    if group is default:
        return rank
    inverse = _inverse.get(group)
    if inverse is None:
        ranks = dist.distributed_c10d._world.pg_group_ranks.get(group)
        if ranks is None:
            return None
        inverse = _inverse[group] = {local: g for g, local in ranks.items()}
    return inverse.get(rank)


# -- a window's ops in the collective count's posts ------------------------------------------------
def encode(ops: Mapping[str, int], peers: Iterable[int]) -> list[str]:
    """The post's tokens: sent and received per peer this rank exchanged with (zeros included)."""
    return [f"{d}{p}={ops.get(f'{d}{p}', 0)}" for p in sorted(peers) for d in (SENT, RECEIVED)]


def is_token(key: str) -> bool:
    return key[:1] in (SENT, RECEIVED)


def peers_in(ops: Mapping[str, int]) -> set[int]:
    return {int(k[1:]) for k in ops}


def mismatch(rank: int, mine: Mapping[str, int], peer: int, theirs: Mapping[str, int]) -> str | None:
    """Where what ``rank`` sent to ``peer`` is not what ``peer`` received from it (either way)."""
    parts = []
    for a, b, a_ops, b_ops in ((rank, peer, mine, theirs), (peer, rank, theirs, mine)):
        sent, got = a_ops.get(f"{SENT}{b}", 0), b_ops.get(f"{RECEIVED}{a}", 0)
        if sent != got:
            parts.append(f"rank {a} sent {sent} tensors to rank {b}, which received {got} from it")
    return "; ".join(parts) or None


Read = Callable[[int], "tuple[bool, Mapping[str, int], bool] | None"]  # peer -> (closed, ops, blocked)


def diagnose_hang(
    rank: int,
    ops: Mapping[str, int],
    peers: Iterable[int],
    where: str,
    read: Read,
    *,
    blocked: bool,
    wait_s: float,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> str | None:
    """At a hang (the monitor thread, once this rank's open window was posted for its peers): a
    peer that closed the window having sent this rank fewer tensors than it posted receives for
    (it waits for one that never comes), or a peer blocked as this rank is (``blocked``), each
    having posted receives the other never sent: a deadlock no correct schedule has. ``read(p)``
    is ``p``'s post of the window, closed or hung, or None. A blocked rank waits up to ``wait_s``
    for its peers' posts: they are diagnosing the same hang at the same moment."""
    pending, deadline = set(peers), clock() + (wait_s if blocked else 0.0)
    while True:
        for p in sorted(pending):
            got = read(p)
            if got is None:
                continue
            pending.discard(p)
            closed, theirs, theirs_blocked = got
            mine_from, theirs_to = ops.get(f"{RECEIVED}{p}", 0), theirs.get(f"{SENT}{rank}", 0)
            if closed and mine_from > theirs_to:
                return (
                    f"point-to-point desync in {where}: rank {p} reached the next check after sending "
                    f"{theirs_to} tensors to rank {rank}, which has posted {mine_from} receives from it "
                    "and waits in the last"
                )
            if not closed and blocked and theirs_blocked and mine_from > theirs_to:
                theirs_from, mine_to = theirs.get(f"{RECEIVED}{rank}", 0), ops.get(f"{SENT}{p}", 0)
                if theirs_from > mine_to:
                    return (
                        f"point-to-point desync in {where}: ranks {rank} and {p} wait for each other: "
                        f"rank {rank} posted {mine_from} receives from rank {p}, which sent {theirs_to}; "
                        f"rank {p} posted {theirs_from} receives from rank {rank}, which sent {mine_to}"
                    )
        if not pending or clock() >= deadline:
            return None
        sleep(0.01)
