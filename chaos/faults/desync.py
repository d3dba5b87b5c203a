"""A rank that skips collectives its peers issue: silent corruption unless something compares
(detectors/collectives.py).

With a ``DistributedDataParallel`` model among the tracked ``objects`` the rank does not all-reduce
that step's gradients; otherwise its next ``torch.distributed`` collective call returns without
communicating. Its peers' collectives then pair with the wrong ones.

DDP's switch, ``require_backward_grad_sync``, is the script's as well: a loop with gradient
accumulation sets it before every micro-step (``= micro_step == accum_steps - 1``) and
``no_sync()`` sets and restores it, so turning it off once at the step's start is undone before
the step's last backward. For the faulted step the instance's class is swapped for a subclass
whose ``require_backward_grad_sync`` is a property: DDP reads False; what the script writes lands
where a plain DDP keeps it, and is what the script finds once the undo puts the class back (a
plain DDP again). A comm hook would do it at the reducer, but DDP takes one per instance: it would
clash with the script's own.

The fault acted when a tracked DDP ran a forward with gradients on while the script wanted that
forward synchronized (its backward is then not all-reduced by this rank), or when the patched
collective was called; otherwise the rank had nothing to skip, and the undo says so.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from chaos.faults.base import InProcess, Undo

if TYPE_CHECKING:
    from chaos.inject import Fault

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
_SYNC = "require_backward_grad_sync"
_SUPPRESSED = "_chaos_desync_suppressed"  # an instance's forwards whose gradient sync was suppressed
_SUBCLASSES: dict[type, type] = {}  # a DDP class → its suppressing subclass (one per class, reused)


class Desync(InProcess):
    name = "desync"
    summary = (
        "the rank skips one step's gradient all-reduce (DDP's sync off for that step), else its next "
        "collective call: its peers pair with the wrong collectives"
    )

    def inject(self, fault: Fault, objects: Iterable[object]) -> Undo | None:
        from torch.nn.parallel import DistributedDataParallel

        ddp = [o for o in objects if isinstance(o, DistributedDataParallel)]
        return _suppress_grad_sync(ddp, fault.step) if ddp else _skip_next_collective(fault.step)


def _suppress_grad_sync(ddp: list[Any], step: int) -> Undo:
    """Turn off each of ``ddp``'s gradient sync until the undo, however the script sets it."""
    swapped = [(m, type(m)) for m in ddp]
    for m, base in swapped:
        m.__class__ = _suppressing(base)
    said: list[str | None] = []

    def resync() -> str | None:
        if not said:  # (once: a second call finds nothing swapped and must not say otherwise)
            suppressed = 0
            for m, base in swapped:
                if type(m) is _suppressing(base):
                    m.__class__ = base
                suppressed += m.__dict__.pop(_SUPPRESSED, 0)
            said.append(
                None
                if suppressed
                else f"no tracked DistributedDataParallel ran a forward with gradients on and its sync "
                f"wanted in step {step}: the rank had no gradient all-reduce to skip"
            )
        return said[0]

    return resync


def _suppressing(base: type) -> type:
    """``base`` (a DDP class) whose gradient sync reads off; what the script sets is kept in the
    instance, where ``base`` keeps it, and counted forwards say whether the fault acted."""
    if base not in _SUBCLASSES:
        _SUBCLASSES[base] = _subclass(base)
    return _SUBCLASSES[base]


def _subclass(base: type) -> type:
    import torch

    def wanted(self: Any) -> Any:  # the value the script set last
        return self.__dict__.get(_SYNC, getattr(base, _SYNC, True))

    def read(self: Any) -> bool:
        return False

    def write(self: Any, value: Any) -> None:
        self.__dict__[_SYNC] = value

    @contextlib.contextmanager
    def no_sync(self: Any) -> Iterator[None]:  # (DDP's own would save the False it reads, for good)
        old = wanted(self)
        self.__dict__[_SYNC] = False
        try:
            yield
        finally:
            self.__dict__[_SYNC] = old

    def forward(self: Any, *inputs: Any, **kwargs: Any) -> Any:
        # (a DDP that delays every parameter's all-reduce ignores the switch: nothing suppressed)
        delayed = getattr(self, "_delay_all_reduce_all_params", False)
        if torch.is_grad_enabled() and wanted(self) and not delayed:
            self.__dict__[_SUPPRESSED] = self.__dict__.get(_SUPPRESSED, 0) + 1
        return base.forward(self, *inputs, **kwargs)  # type: ignore[attr-defined]

    namespace = {_SYNC: property(read, write), "no_sync": no_sync, "forward": forward}
    return type(base.__name__, (base,), namespace)  # (its name: the module's repr reads as before)


def _skip_next_collective(step: int) -> Undo:
    """The rank's next ``torch.distributed`` collective call in the step is not issued at all."""
    import torch.distributed as dist

    originals = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}
    calls: list[str] = []

    def restore() -> str | None:
        for name, fn in originals.items():
            if getattr(dist, name) is skipped:  # (not a wrapper someone installed since)
                setattr(dist, name, fn)
        if calls:
            return None
        return (
            f"the rank called no torch.distributed collective in step {step} and tracks no "
            "DistributedDataParallel: it had nothing to skip"
        )

    def skipped(*_args: Any, **kwargs: Any) -> Any:
        calls.append("called")
        restore()
        return _Skipped() if kwargs.get("async_op") else None

    for name in originals:
        setattr(dist, name, skipped)
    return restore


class _Skipped:
    """What a skipped ``async_op=True`` collective hands back: done, with nothing exchanged."""

    def wait(self, *_args: Any) -> bool:
        return True

    def is_completed(self) -> bool:
        return True
