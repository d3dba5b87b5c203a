"""Fault points inside a step: a microbatch's forward or backward in a pipeline stage.

A pipeline's schedule runs many forwards and backwards in one step, and a fault in the middle of
it leaves the other stages blocked in their sends and receives, which a fault at the step's start
never does. A plan entry ``kind@step:rank/forward2`` (or ``/backward2``) is armed at the step's
start on the first tracked ``nn.Module`` (the stage's module; DDP's and FSDP's wrappers included)
and fired at its third forward of the step, or in the backward of that forward's output.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

Fire = Callable[[], None]


class Point:
    """Where a fault fires inside a step: ``forward`` or ``backward`` of microbatch ``index``."""

    def __init__(self, at: str, index: int) -> None:
        self.at, self.index = at, index

    def __str__(self) -> str:
        return f"{self.at} of microbatch {self.index}"

    def arm(self, objects: Iterable[object], fire: Fire) -> Callable[[], str | None] | None:
        """Hook the first module of ``objects`` to call ``fire`` there; returns the hooks'
        removal, which says why the point never came in the step, if it did not (None: no module
        is tracked, nothing is armed)."""
        import torch

        module = next((o for o in objects if isinstance(o, torch.nn.Module)), None)
        if module is None:
            return None
        seen = [0]
        fired = [False]

        def once() -> None:
            if not fired[0]:
                fired[0] = True
                fire()

        def pre(_m: Any, _args: Any) -> None:
            seen[0] += 1
            if self.at == "forward" and seen[0] - 1 == self.index:
                once()

        def post(_m: Any, _args: Any, out: Any) -> None:
            if self.at == "backward" and seen[0] - 1 == self.index:
                t = out[0] if isinstance(out, tuple | list) else out
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda g: _then(once, g))

        hooks = [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

        def disarm() -> str | None:
            for h in hooks:
                h.remove()
            if fired[0]:
                return None
            return f"its point, the {self} of the stage's module, never came: the step ran {seen[0]} forwards"

        return disarm


def _then(fire: Fire, grad: Any) -> Any:
    fire()
    return grad
