"""Collective fingerprints: a step is kept only if every rank issued the same collectives in it.

A rank that skips a collective (or issues an extra one) pairs every later collective of the
group with the wrong one on its peers. With NCCL, or gloo collectives of equal shape, the results
are silently wrong and the step completes; with a snapshot or a checkpoint taken after it, the
corruption would be restored as "the last good state". (Measured with gloo: rank 1 skipping one
of four equal all-reduces gives rank 0 the sum of its 2nd and rank 1's 3rd tensor, no error.)

The process group's sequence number counts every collective issued on it, DDP's bucket
all-reduces and buffer broadcasts included. The runtime reads it at each step's start; at the
step's end, before the next step's state is captured, each rank posts how many collectives it
issued to the store (out of band: the desynchronized group cannot be trusted to carry it) and
compares with its ring neighbour's count. Equal counts around the ring mean equal counts
everywhere; a difference raises :class:`CollectiveDesync` before anything is captured.

A rank blocked in a collective its peer never issued never reaches its step's end: its watchdog
sees a hang, and :meth:`CollectiveCount.diagnose` turns it into a desync when a neighbour
finished the step after fewer collectives than this rank has issued so far.

Ranks that legitimately issue different collectives on the default group in one step (e.g.
pipeline stages' point-to-point traffic on it) turn the check off: ``collective_check: false``.
"""

from __future__ import annotations

import time

import torch.distributed as dist

from resilient.errors import SoftFault


class CollectiveDesync(SoftFault):
    """Ranks issued different numbers of collectives in one step (recovered in-process)."""


def _seq() -> int:
    try:
        pg = dist.distributed_c10d._get_default_group()
        return int(pg._get_sequence_number_for_group())  # type: ignore[attr-defined]
    except (RuntimeError, ValueError, AttributeError):  # no group (destroyed), or a backend without
        return -1


class CollectiveCount:
    """Per-step collective counts of one rank, posted under ``<prefix>/<step>/<rank>``."""

    def __init__(self, store: dist.Store, prefix: str, rank: int, world_size: int) -> None:
        self.store, self.prefix, self.rank, self.world = store, prefix, rank, world_size
        self.step: int | None = None
        self._base = 0
        self._posted: list[int] = []  # own keys not yet deleted

    def _key(self, step: int, rank: int) -> str:
        return f"{self.prefix}/{step}/{rank}"

    def begin(self, step: int) -> None:
        self.step, self._base = step, _seq()

    def issued(self) -> int:
        return _seq() - self._base

    def check(self, step: int) -> None:
        """Post this rank's count for ``step`` and compare it with the next rank's (blocks until
        that rank finished the step; a peer that never does is a hang, and the watchdog's)."""
        n = self.issued()
        self.store.set(self._key(step, self.rank), str(n))
        self._posted.append(step)
        if self.world == 1:
            return
        peer = (self.rank + 1) % self.world
        other = self._await(self._key(step, peer))
        if other != n:
            raise CollectiveDesync(
                f"collective desync in step {step}: rank {self.rank} issued {n} collectives, "
                f"rank {peer} issued {other}; the step's state is not kept"
            )
        if n > 0:  # a collective of this step means every rank finished reading the step before
            done = [s for s in self._posted if s < step]
            for s in done:
                self.store.delete_key(self._key(s, self.rank))
            self._posted = [s for s in self._posted if s >= step]

    def _await(self, key: str) -> int:
        # A blocking store wait cannot be interrupted by the runtime (the signal that ends a
        # step is only handled between bytecodes) and a timed-out wait leaves the connection out
        # of step with the server: poll instead. The peer is normally there within a collective's
        # latency (it just left the same last collective), so the first 0.3 ms poll back to back
        # (a check is ~15 us here; a sleep, however short, ~170 us), then back off to 10 ms. (Not
        # longer: on a machine with fewer cores than busy processes a spin takes the CPU from the
        # very peer it waits for.)
        spin_until = time.perf_counter() + 0.0003
        while not self.store.check([key]):
            if time.perf_counter() > spin_until:
                self._backoff(key)
                break
        return int(self.store.get(key))

    def _backoff(self, key: str) -> None:
        delay = 2e-4
        while not self.store.check([key]):
            time.sleep(delay)
            delay = min(2 * delay, 0.01)

    def diagnose(self, store: dist.Store) -> str | None:
        """From the monitor thread (its own store connection), while this rank seems hung: a
        neighbour that finished the current step after fewer collectives than this rank has
        issued in it means this rank waits in a collective the neighbour never issued."""
        step = self.step
        if step is None or self.world == 1:
            return None
        n = self.issued()
        for peer in sorted({(self.rank - 1) % self.world, (self.rank + 1) % self.world}):
            key = self._key(step, peer)
            try:
                if not store.check([key]):
                    continue
                other = int(store.get(key))
            except Exception:  # the store is unreachable: no diagnosis, the hang stands
                return None
            if other < n:
                return (
                    f"collective desync in step {step}: rank {peer} finished the step after {other} "
                    f"collectives, rank {self.rank} has issued {n} and waits in the last one"
                )
        return None
