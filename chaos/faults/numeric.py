"""Faults in the numbers, not the process: a step's gradient turned NaN, or scaled far up.

Both act on the gradient as backward produces it: a hook on the tracked model's output changes
the gradient flowing back into it during that step (the hooks go once the step is over). Every
parameter's gradient is derived from it, before DDP's all-reduce or FSDP2's reduce-scatter, as
one from a bad kernel would be; every rank's optimizer is then about to apply it. Nothing raises;
only a check before ``optimizer.step`` can keep it from the weights.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, ClassVar

from chaos.faults.base import Evidence, InProcess, Undo
from resilient.events import Event

if TYPE_CHECKING:
    import torch

    from chaos.inject import Fault

# a step the guard rejected is a fault like any other: fault_detected, then a roll-back
NUMERIC = Evidence("fault", (Event.FAULT_DETECTED,), True)


def _first_grad_tensor(out: Any) -> torch.Tensor | None:
    """The first tensor of a model's output that backward flows through (logits, a loss...)."""
    import torch

    if isinstance(out, torch.Tensor):
        return out if out.requires_grad else None
    values = out.values() if isinstance(out, dict) else out if isinstance(out, list | tuple) else ()
    for v in values:
        t = _first_grad_tensor(v)
        if t is not None:
            return t
    return None


def _on_output_gradient(
    objects: Iterable[object], fn: Callable[[torch.Tensor], torch.Tensor], step: int
) -> Undo:
    """``fn`` changes the gradient that flows back into each tracked model's output this step; the
    undo says so when none flowed (no backward through a tracked model in the step)."""
    import torch

    modules = [o for o in objects if isinstance(o, torch.nn.Module)]
    if not modules:
        raise ValueError("no tracked model (torch.nn.Module) whose gradient could be faulted")
    changed: list[bool] = []

    def counted(g: torch.Tensor) -> torch.Tensor:
        changed.append(True)
        return fn(g)

    def hook(_module: torch.nn.Module, _args: Any, out: Any) -> None:
        t = _first_grad_tensor(out)
        if t is not None:
            t.register_hook(counted)

    handles = [m.register_forward_hook(hook) for m in modules]

    def remove() -> str | None:
        for h in handles:
            h.remove()
        if changed:
            return None
        return f"no gradient flowed back into a tracked model's output in step {step}: nothing to change"

    return remove


class NanGradient(InProcess):
    name = "nan"
    summary = (
        "a NaN in one element of the gradient flowing back into the rank's model output: every "
        "gradient of the step turns NaN (before DDP's all-reduce)"
    )
    evidence: ClassVar[Evidence] = NUMERIC

    def inject(self, fault: Fault, objects: Iterable[object]) -> Undo | None:
        def poison(g: torch.Tensor) -> torch.Tensor:
            g = g.clone()
            g.view(-1)[0] = float("nan")
            return g

        return _on_output_gradient(objects, poison, fault.step)


class GradSpike(InProcess):
    name = "grad_spike"
    summary = (
        "the gradient flowing back into the rank's model output scaled by `arg` (default 1e6): "
        "a spike, every value finite"
    )
    arg = "factor"
    evidence: ClassVar[Evidence] = NUMERIC
    FACTOR: ClassVar[float] = 1e6

    def inject(self, fault: Fault, objects: Iterable[object]) -> Undo | None:
        factor = fault.arg if fault.arg is not None else self.FACTOR
        return _on_output_gradient(objects, lambda g: g * factor, fault.step)
