"""Silent data corruption: one bit of one weight flips on one rank, and nothing raises.

The flip comes right after the step's optimizer step (a step post-hook on the tracked optimizer,
which removes itself), so the corrupt weight is what the rank keeps and trains on from then on,
as after a memory or compute error on its accelerator. It is the lowest exponent bit of the first
element of the model's first floating-point parameter: the weight doubles or halves, which
matters, without turning the run into NaNs. Only a comparison of the replicas finds it (``sdc``:
resilient/detectors/replicas.py). Without a tracked optimizer the weight flips at once, at the start of
the step; without a tracked module there is nothing to flip (the injection raises, by name).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from chaos.faults.base import Evidence, InjectedFault, InProcess, Undo
from resilient.events import Event

if TYPE_CHECKING:
    import torch

    from chaos.inject import Fault

# the lowest exponent bit of each floating-point dtype's bit pattern, and the integer view of it
_EXPONENT_LSB = {"float64": 52, "float32": 23, "float16": 10, "bfloat16": 7}


def flip_bit(t: torch.Tensor, index: int = 0, bit: int | None = None) -> None:
    """Flip ``bit`` (default: the lowest exponent bit) of element ``index`` of ``t``, in place."""
    import torch

    name = str(t.dtype).removeprefix("torch.")
    bit = _EXPONENT_LSB.get(name, 0) if bit is None else bit
    width = t.element_size() * 8
    words = {8: torch.uint8, 16: torch.int16, 32: torch.int32, 64: torch.int64}[width]
    with torch.no_grad():
        view = t.detach().view(words)  # (same element size: any layout)
        where = tuple(int(i) for i in torch.unravel_index(torch.tensor(index), t.shape)) if t.dim() else ()
        value = 1 << bit
        if words is not torch.uint8 and value >= 1 << (width - 1):  # (the sign bit of a signed view)
            value -= 1 << width
        view[where] ^= torch.tensor(value, dtype=words, device=t.device)


class Bitflip(InProcess):
    name = "bitflip"
    summary = (
        "one bit (the lowest exponent bit) of one weight of the tracked model flips on the rank, after "
        "its optimizer step: silent until the replicas' digests are compared"
    )
    evidence = Evidence("replicas differ", (Event.FAULT_DETECTED,), True)

    def inject(self, fault: Fault, objects: Iterable[object]) -> Undo | None:
        import torch

        state = list(objects)
        module = next((o for o in state if isinstance(o, torch.nn.Module)), None)
        if module is None:
            raise InjectedFault("bitflip: no tracked torch.nn.Module to flip a bit in")
        # a DTensor's (FSDP2, HSDP, TP) flip is in this rank's own shard: a DTensor op on the
        # parameter itself would issue a collective only this rank makes
        local = [getattr(p, "_local_tensor", p) for p in module.parameters()]
        param = next(t for t in local if t.is_floating_point() and t.numel() > 0)
        optimizer = next((o for o in state if isinstance(o, torch.optim.Optimizer)), None)
        if optimizer is None:
            flip_bit(param)
            return None

        flipped: list[bool] = []

        def after_step(*_: Any) -> None:
            handle.remove()
            flip_bit(param)
            flipped.append(True)

        def undo() -> str | None:
            handle.remove()
            if flipped:
                return None
            return f"the tracked optimizer took no step in step {fault.step}: no weight flipped"

        handle = optimizer.register_step_post_hook(after_step)
        return undo
