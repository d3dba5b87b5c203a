"""Faults in the numbers, not the process: a step's gradient turned NaN, or scaled far up.

Both act on the gradient as backward produces it (a tensor hook on the tracked model's
parameters, removed once the step is over): under DDP the bad gradient then goes into the
all-reduce like one from a bad kernel would, and every rank's optimizer is about to apply it.
Nothing raises; only a check before ``optimizer.step`` can keep it from the weights.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, ClassVar

from chaos.faults.base import Evidence, InProcess, Undo

if TYPE_CHECKING:
    import torch

    from chaos.inject import Fault

# a step the guard rejected is a fault like any other: fault_detected, then a roll-back
NUMERIC = Evidence("fault", ("fault_detected",), True)


def _parameters(objects: Iterable[object]) -> list[torch.Tensor]:
    """The trainable parameters of the tracked model(s), else of the tracked optimizer(s)."""
    import torch

    objects = list(objects)
    modules = [o for o in objects if isinstance(o, torch.nn.Module)]
    params: list[torch.Tensor] = [p for m in modules for p in m.parameters() if p.requires_grad]
    if not params:
        params = [
            p
            for o in objects
            if isinstance(o, torch.optim.Optimizer)
            for g in o.param_groups
            for p in g["params"]
            if p.requires_grad
        ]
    if not params:
        raise ValueError("no tracked model or optimizer with trainable parameters to fault")
    return params


def _hooked(params: list[torch.Tensor], fn: Callable[[torch.Tensor], torch.Tensor]) -> Undo:
    handles = [p.register_hook(fn) for p in params]

    def remove() -> None:
        for h in handles:
            h.remove()

    return remove


class NanGradient(InProcess):
    name = "nan"
    summary = "a NaN written into one element of the rank's gradient in backward (before DDP's all-reduce)"
    evidence: ClassVar[Evidence] = NUMERIC

    def inject(self, fault: Fault, objects: Iterable[object]) -> Undo | None:
        def poison(g: torch.Tensor) -> torch.Tensor:
            g = g.clone()
            g.view(-1)[0] = float("nan")
            return g

        return _hooked(_parameters(objects)[:1], poison)


class GradSpike(InProcess):
    name = "grad_spike"
    summary = "the rank's gradient scaled by `arg` (default 1e6) in backward: a spike, every value finite"
    arg = "factor"
    evidence: ClassVar[Evidence] = NUMERIC
    FACTOR: ClassVar[float] = 1e6

    def inject(self, fault: Fault, objects: Iterable[object]) -> Undo | None:
        factor = fault.arg if fault.arg is not None else self.FACTOR
        return _hooked(_parameters(objects), lambda g: g * factor)


__all__ = ["GradSpike", "NanGradient"]
