"""Fault injectors keyed by (rank, step): each one a real fault, each counting what fired.

A plan is written ``kind@step[:rank][xN]``, comma-separated, e.g. ``exception@5:1,hang@9:0``.
``xN`` repeats the fault at that step N times (every time the step is re-run after a restart,
up to N); without it a fault fires once. Kinds:

- ``exception``: raise :class:`InjectedFault` inside the step.
- ``hang``: ``time.sleep(3600)`` inside the step — a real hang; only an interrupt ends it.
- ``stall``: ``time.sleep(seconds)`` before the step's first collective (``stall@4:1=2.5``): a peer's
  collective waits past its timeout.
- ``oom``: allocate far more host memory than exists — a real allocation failure from the allocator.
- ``cuda_oom``: allocate far more device memory than the GPU has — a real ``torch.OutOfMemoryError``.
- ``kernel_oom``: touch memory until the kernel's OOM killer SIGKILLs the process — only inside a
  memory-limited cgroup (refused otherwise: it would take the whole machine's memory).
- ``gil_hang``: a regular-expression match with catastrophic backtracking: C code that holds the
  GIL for hours, unreachable by signals and other Python threads (a hard fault).
- ``desync``: the rank skips collectives its peers issue. With a ``DistributedDataParallel`` model
  among ``objects`` (the runtime passes its tracked state) the rank does not all-reduce that step's
  gradients (DDP's ``require_backward_grad_sync``, off for this one step); otherwise its next
  ``torch.distributed`` collective call returns without communicating. Its peers' collectives then
  pair with the wrong ones: silent corruption unless something compares (runtime/collective_check.py).
"""

from __future__ import annotations

import json
import os
import re
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import psutil

from resilient.events import read_events

KINDS = ("exception", "hang", "stall", "oom", "cuda_oom", "kernel_oom", "gil_hang", "desync")
_COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "reduce",
    "all_to_all_single",
    "barrier",
    "all_gather_single",
    "reduce_scatter_single",
)  # fmt: skip  (FSDP2 calls the last two)
_SPEC = re.compile(
    r"^(?P<kind>[a-z_]+)@(?P<step>\d+)(?::(?P<rank>\d+))?(?:=(?P<arg>[\d.]+))?(?:x(?P<n>\d+))?$"
)


class InjectedFault(Exception):
    """The exception a chaos injector raises; its message names the injection."""


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int = 0
    arg: float | None = None
    times: int = 1

    @property
    def where(self) -> str:
        return "before_collective" if self.kind == "stall" else "step"


@dataclass
class Injector:
    """Fires the faults of a plan when ``(rank, step, where)`` matches; counts what fired."""

    faults: list[Fault] = field(default_factory=list)
    fired: Counter[Fault] = field(default_factory=Counter)
    _undo: list[tuple[int, Any]] = field(default_factory=list)  # (step, callable) one-step changes

    @classmethod
    def parse(cls, plan: str | None) -> Injector:
        faults = []
        for part in filter(None, (p.strip() for p in (plan or "").split(","))):
            m = _SPEC.match(part)
            if not m or m["kind"] not in KINDS:
                raise ValueError(
                    f"bad fault spec {part!r}: expected kind@step[:rank][=arg][xN], kind in {KINDS}"
                )
            faults.append(
                Fault(
                    kind=m["kind"],
                    step=int(m["step"]),
                    rank=int(m["rank"] or 0),
                    arg=float(m["arg"]) if m["arg"] else None,
                    times=int(m["n"] or 1),
                )
            )
        return cls(faults)

    def maybe_fire(self, rank: int, step: int, where: str = "step", objects: Iterable[object] = ()) -> None:
        """Fire the faults planned for ``(rank, step, where)``. ``objects``: the state the runtime
        tracks (a ``desync`` acts on a DDP model among them)."""
        for s, undo in [u for u in self._undo if u[0] != step]:  # a one-step change (desync) ends
            undo()
            self._undo.remove((s, undo))
        for f in self.faults:
            if f.rank == rank and f.step == step and f.where == where and self.fired[f] < f.times:
                self.fired[f] += 1
                if _fired_in_job(f) >= f.times:  # an earlier process of this job fired it already
                    continue
                _record(f)
                if f.kind == "desync":
                    self._undo += [(step, u) for u in _desync(objects)]
                else:
                    _fire(f)

    def counts(self) -> dict[str, int]:
        return {f"{f.kind}@{f.step}:{f.rank}": self.fired[f] for f in self.faults}


def _fired_in_job(f: Fault) -> int:
    """How often earlier processes of this job fired ``f`` (``$CHAOS_INJECTIONS``): a relaunched
    worker must not fire a planned fault again (a fault per plan entry, not per process)."""
    path = os.environ.get("CHAOS_INJECTIONS")  # chaos.hooks.Var.INJECTIONS
    if not path:
        return 0
    return sum(
        r.get("by") == "injector" and (r["kind"], r["step"], r["rank"]) == (f.kind, f.step, f.rank)
        for r in read_events(path)
    )


def _record(f: Fault) -> None:
    """Append what is about to fire, and when, to ``$CHAOS_INJECTIONS`` (the certificate's t0)."""
    path = os.environ.get("CHAOS_INJECTIONS")
    if not path:
        return
    line = json.dumps({"ts": time.time(), "kind": f.kind, "rank": f.rank, "step": f.step, "pid": os.getpid(),
                       "by": "injector"})  # fmt: skip
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (line + "\n").encode())  # one write: lines of different ranks never interleave
        os.fsync(fd)  # the next thing may be a hang, an OOM-kill or a GIL-bound loop
    finally:
        os.close(fd)


def _fire(f: Fault) -> None:
    if f.kind == "exception":
        raise InjectedFault(f"injected exception at step {f.step} on rank {f.rank}")
    if f.kind == "hang":
        time.sleep(3600)
    elif f.kind == "stall":
        time.sleep(f.arg if f.arg is not None else 5.0)
    elif f.kind == "oom":
        # More than the machine has: the allocator fails for real. Under vm.overcommit_memory=1 the
        # kernel would grant it and the OOM killer would strike later instead: refuse, naming why.
        import torch

        with open("/proc/sys/vm/overcommit_memory") as fh:
            if fh.read().strip() == "1":
                raise RuntimeError("oom injector needs vm.overcommit_memory != 1 (it is 1 here)")

        too_much = int(psutil.virtual_memory().total * 4)
        torch.empty(too_much, dtype=torch.uint8).fill_(1)
    elif f.kind == "cuda_oom":
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("cuda_oom injector needs a GPU (none is present)")
        _free, total = torch.cuda.mem_get_info()
        torch.empty(int(total * 4), dtype=torch.uint8, device="cuda")
    elif f.kind == "kernel_oom":
        limit = _cgroup_memory_limit()
        if limit is None or limit >= psutil.virtual_memory().total:
            raise RuntimeError("kernel_oom injector needs a memory-limited cgroup (this process has none)")
        hold = []
        while True:  # each chunk is written, so its pages are really charged to the cgroup
            chunk = bytearray(64 << 20)
            chunk[::4096] = b"\x01" * len(range(0, len(chunk), 4096))
            hold.append(chunk)
    elif f.kind == "gil_hang":
        re.match(r"(a+)+$", "a" * 64 + "b")


def _desync(objects: Iterable[object]) -> list[Any]:
    """Make this rank skip collectives its peers issue; return what undoes it after the step."""
    from torch.nn.parallel import DistributedDataParallel

    ddp = [o for o in objects if isinstance(o, DistributedDataParallel)]
    if ddp:  # this step's gradient all-reduces are not issued by this rank (DDP's no_sync path)
        for m in ddp:
            m.require_backward_grad_sync = False
        return [lambda m=m: setattr(m, "require_backward_grad_sync", True) for m in ddp]
    import torch.distributed as dist

    originals = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}

    def restore() -> None:
        for name, fn in originals.items():
            setattr(dist, name, fn)

    def skipped(*_args: Any, **kwargs: Any) -> Any:  # the next collective call: not issued at all
        restore()
        return _Skipped() if kwargs.get("async_op") else None

    for name in originals:
        setattr(dist, name, skipped)
    return [restore]


class _Skipped:
    """What a skipped ``async_op=True`` collective hands back: done, with nothing exchanged."""

    def wait(self, *_args: Any) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _cgroup_memory_limit() -> int | None:
    """This process's cgroup memory limit in bytes (v1 ``memory.limit_in_bytes`` or v2 ``memory.max``)."""
    try:
        lines = open("/proc/self/cgroup").read().splitlines()  # noqa: SIM115
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            candidates = [f"/sys/fs/cgroup/memory{path}/memory.limit_in_bytes"]
        elif controllers == "":
            candidates = [f"/sys/fs/cgroup{path}/memory.max", f"/sys/fs/cgroup/unified{path}/memory.max"]
        else:
            continue
        for c in candidates:
            try:
                raw = open(c).read().strip()  # noqa: SIM115
            except OSError:
                continue
            if raw != "max":
                return int(raw)
    return None
