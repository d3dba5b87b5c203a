"""A pipeline stage that skips one send: its peer waits for a tensor that never comes.

The rank's next point-to-point send (``ProcessGroup.send``, which ``send``, ``isend`` and
``batch_isend_irecv`` all reach) returns a completed request without sending anything: a
microbatch's activations (``/forwardM``: that microbatch's) or gradients are never sent. The
receiver blocks; a microbatch later the sender blocks on what the receiver no longer sends back.
The collective count's point-to-point tallies name it a desync (resilient/detectors/p2p.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from chaos.faults.base import InProcess, Undo

if TYPE_CHECKING:
    from chaos.inject import Fault


class P2pSkip(InProcess):
    name = "p2p_skip"
    summary = (
        "the rank's next point-to-point send is not sent (a pipeline stage skips a microbatch's "
        "activations or gradients): its peer waits for it, then the rank for its peer"
    )

    def inject(self, fault: Fault, objects: Iterable[object]) -> Undo | None:
        import torch.distributed as dist

        send = dist.ProcessGroup.send  # (the collective count's wrapper, where it is installed)
        sends: list[str] = []

        def restore() -> str | None:
            if dist.ProcessGroup.send is skipped:
                dist.ProcessGroup.send = send  # type: ignore[method-assign]
            if sends:
                return None
            return f"the rank sent nothing point-to-point in step {fault.step}: no send to skip"

        def skipped(*_args: Any, **_kwargs: Any) -> Any:
            sends.append("skipped")
            restore()
            return _Sent()

        dist.ProcessGroup.send = skipped  # type: ignore[method-assign]
        return restore


class _Sent:
    """What the skipped send hands back: done, with nothing sent."""

    def wait(self, *_args: Any) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> None:
        return None
