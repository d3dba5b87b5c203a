"""A rank that skips collectives its peers issue: silent corruption unless something compares
(detectors/collectives.py).

With a ``DistributedDataParallel`` model among the tracked ``objects`` the rank does not all-reduce
that step's gradients (DDP's ``require_backward_grad_sync``, off for this one step); otherwise its
next ``torch.distributed`` collective call returns without communicating. Its peers' collectives
then pair with the wrong ones.
"""

from __future__ import annotations

from collections.abc import Iterable
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


class Desync(InProcess):
    name = "desync"
    summary = (
        "the rank skips one step's gradient all-reduce (DDP's sync off for that step), else its next "
        "collective call: its peers pair with the wrong collectives"
    )

    def inject(self, fault: Fault, objects: Iterable[object]) -> Undo | None:
        from torch.nn.parallel import DistributedDataParallel

        ddp = [o for o in objects if isinstance(o, DistributedDataParallel)]
        if ddp:  # this step's gradient all-reduces are not issued by this rank (DDP's no_sync path)
            for m in ddp:
                m.require_backward_grad_sync = False

            def resync() -> None:
                for m in ddp:
                    m.require_backward_grad_sync = True

            return resync
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
        return restore


class _Skipped:
    """What a skipped ``async_op=True`` collective hands back: done, with nothing exchanged."""

    def wait(self, *_args: Any) -> bool:
        return True

    def is_completed(self) -> bool:
        return True
