"""Objects from ``accelerator.prepare`` made trackable (``resilient.integrations.hf.trackable``).

- ``AcceleratedOptimizer`` is an ``Optimizer`` that never ran ``Optimizer.__init__``: it has no
  step-hook registries, so the runtime cannot hook it (its gradient guard, the accumulation-window
  bookkeeping). Its inner optimizer is tracked instead: the same state, and the hooks fire there.
- ``DataLoaderShard`` over a plain ``DataLoader`` has a ``state_dict`` that fails (accelerate keeps
  one only for torchdata's loader). It is made resumable in place: its inner loader becomes the
  runtime's resumable ``DataLoader`` (the pass recreated from the RNG states it began from, the
  consumed batches skipped in the sampler, nothing read); the shard reads one batch ahead, so
  its position is what it yielded, one less than its inner loader's while a pass runs; the
  generator accelerate synchronizes across ranks at each pass is kept as the pass began.
- The ``Accelerator`` itself: its step counter (``accelerator.accumulate`` decides from it when a
  window ends) and, under fp16, its ``GradScaler``.
- Anything else (the wrapped model, ``AcceleratedScheduler``) is tracked as it is.
"""

from __future__ import annotations

from typing import Any

import torch

from resilient.errors import ResilienceError
from resilient.state.loader import make_resumable


class NotTrackable(ResilienceError):
    """A prepared object the runtime cannot restore exactly; the message names it and why."""


class ShardPosition:
    """A ``DataLoaderShard``'s position (see the module docstring). ``ctx.steps``/``ctx.epochs``
    read ``consumed`` and clear ``pending`` through the shard's ``_resilient_pos``."""

    def __init__(self, shard: Any) -> None:
        self.shard = shard
        self.base: Any = shard.base_dataloader
        make_resumable(self.base)
        self._inner = self.base._resilient_pos  # the runtime's position of the inner loader (read, cleared)
        self._begin = shard.begin
        self.sync_pass: torch.Tensor | None = None  # the synchronized generator when this pass began

    @property
    def consumed(self) -> int:
        """Batches the shard yielded in this pass (its inner loader is one ahead until the last)."""
        n = int(self._inner.consumed)
        return n if n == 0 or self.shard.end_of_dataloader else n - 1

    @property
    def pending(self) -> Any:
        return self._inner.pending

    @pending.setter
    def pending(self, value: Any) -> None:
        self._inner.pending = value

    def begin(self) -> None:
        """A pass begins (after accelerate synchronized its generator from rank 0)."""
        g = self.shard.synchronized_generator
        if isinstance(g, torch.Generator):
            pending = self._inner.pending
            if pending is not None and pending.get("rng") is not None and self.sync_pass is not None:
                g.set_state(self.sync_pass)  # a resumed pass: its permutation drawn as the original's
            else:
                self.sync_pass = g.get_state()
        self._begin()

    def state_dict(self) -> dict[str, Any]:
        state = dict(self.base.state_dict())
        state["consumed"] = self.consumed
        state["iteration"] = int(self.shard.iteration)
        g = self.shard.synchronized_generator
        if isinstance(g, torch.Generator):
            state["synchronized"] = {"pass": self.sync_pass, "now": g.get_state()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.base.load_state_dict({k: state[k] for k in ("iterators", "consumed", "rng", "generators")})
        self.shard.iteration = int(state["iteration"])
        g, sync = self.shard.synchronized_generator, state.get("synchronized")
        if isinstance(g, torch.Generator) and sync is not None:
            g.set_state(sync["now"])  # (a resumed pass puts its beginning's back in begin())
            self.sync_pass = sync["pass"]


class AcceleratorProgress:
    """An ``Accelerator``'s own state: its step counter and, under fp16, its gradient scaler."""

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator

    def state_dict(self) -> dict[str, Any]:
        acc = self.accelerator
        state: dict[str, Any] = {"step": int(acc.step)}
        if acc.scaler is not None:
            state["scaler"] = acc.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        acc = self.accelerator
        acc.step = int(state["step"])
        if ("scaler" in state) != (acc.scaler is not None):
            raise ResilienceError(
                f"the Accelerator {'has' if acc.scaler is not None else 'has no'} gradient scaler now, "
                f"and {'had one' if 'scaler' in state else 'had none'} when the snapshot was taken"
            )
        if acc.scaler is not None:
            acc.scaler.load_state_dict(state["scaler"])


def _shard(name: str, shard: Any) -> Any:
    if "_resilient_pos" in shard.__dict__:
        return shard  # (made trackable already: the function re-entered with the same loader)
    if hasattr(shard.base_dataloader, "state_dict"):
        raise NotTrackable(
            f"{name}={type(shard).__name__} over torchdata's StatefulDataLoader "
            "(DataLoaderConfiguration(use_stateful_dataloader=True)): its restore is not exact yet "
            "(it draws a new seed from the global RNG); prepare it with the default loader"
        )
    if getattr(shard, "skip_batches", 0):
        raise NotTrackable(
            f"{name}={type(shard).__name__} skips its first {shard.skip_batches} batches "
            "(accelerator.skip_first_batches): track the loader it was made from"
        )
    pos = ShardPosition(shard)
    # instance attributes: DataLoaderShard forwards unknown names to its inner loader, so these
    # shadow the class's failing state_dict and the inner loader's position (one batch behind)
    shard.__dict__.update(
        _resilient_pos=pos, state_dict=pos.state_dict, load_state_dict=pos.load_state_dict, begin=pos.begin
    )
    return shard


def trackable_one(name: str, obj: Any) -> Any:
    """What ``ctx.track`` gets for one prepared object (see the module docstring)."""
    from accelerate import Accelerator
    from accelerate.data_loader import DataLoaderDispatcher, DataLoaderShard, SkipDataLoader
    from accelerate.optimizer import AcceleratedOptimizer

    if isinstance(obj, AcceleratedOptimizer):
        inner = obj.optimizer
        if not isinstance(inner, torch.optim.Optimizer):
            raise NotTrackable(
                f"{name}=AcceleratedOptimizer wraps a {type(inner).__name__}, not a torch optimizer"
            )
        return inner
    if type(obj) is DataLoaderDispatcher:  # (its __class__ says DataLoader)
        raise NotTrackable(
            f"{name}=DataLoaderDispatcher (dispatch_batches=True: rank 0 reads every rank's batches and "
            "sends them) cannot be restored per rank; prepare it with "
            "DataLoaderConfiguration(dispatch_batches=False)"
        )
    if type(obj) is SkipDataLoader:
        raise NotTrackable(
            f"{name}=SkipDataLoader (accelerator.skip_first_batches): track the loader it was made from"
        )
    if type(obj) is DataLoaderShard:
        return _shard(name, obj)
    if isinstance(obj, Accelerator):
        return AcceleratorProgress(obj)
    return obj
