"""A plain ``torch.utils.data.DataLoader`` made resumable when it is tracked.

A ``DataLoader`` has no ``state_dict``, and creating its iterator draws from the *global* torch RNG
(the workers' base seed; a ``RandomSampler`` without a generator draws its shuffle seed at the
first batch). A restored run that creates the iterator again mid-epoch would draw again, from the
restored stream, and every later random number (dropout, augmentation) would shift.

Tracking a loader gives it, in place, a subclass that records its position: how many iterators it
created (epochs begun), how many batches the current one yielded, and the global RNG state just
before that iterator was created. After a restore, the next ``iter(loader)`` recreates the
iterator *from that recorded RNG state* (the same base seed, the same shuffle), puts the global
RNG back where the snapshot left it, and skips the batches already consumed: by advancing the
sampler alone (no sample is read) in a single-process loader; by reading them again with worker
processes, whose own RNG streams must advance exactly as they did. ``DistributedSampler`` needs
nothing more: its order depends on its seed and the epoch the training loop sets.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

_classes: dict[type, type] = {}


class _Position:
    def __init__(self) -> None:
        self.iterators = 0  # iterators created so far (epochs begun)
        self.consumed = 0  # batches the current iterator yielded
        self.rng: list[torch.Tensor] | None = None  # each RNG source's state before that iterator
        self.pending: dict[str, Any] | None = None  # a restored position, applied at the next iter()
        self.start: dict[str, Any] | None = None  # a StatefulDataLoader's state where its pass began


def _generators(loader: Any) -> list[torch.Generator]:
    """The loader's own generators (its ``generator``, its sampler's), each once."""
    out: list[torch.Generator] = []
    for g in (
        getattr(loader, "generator", None),
        getattr(getattr(loader, "sampler", None), "generator", None),
    ):
        if isinstance(g, torch.Generator) and all(g is not h for h in out):
            out.append(g)
    return out


def _get_states(loader: Any) -> list[torch.Tensor]:
    """The global torch RNG's state, then each of the loader's generators'."""
    return [torch.get_rng_state(), *(g.get_state() for g in _generators(loader))]


def _set_states(loader: Any, states: list[torch.Tensor]) -> None:
    torch.set_rng_state(states[0])
    for g, st in zip(_generators(loader), states[1:], strict=True):
        g.set_state(st)


class _Counting:
    """The loader's iterator, counting the batches it yields."""

    def __init__(self, it: Any, pos: _Position) -> None:
        self._it, self._pos = it, pos

    def __iter__(self) -> _Counting:
        return self

    def __next__(self) -> Any:
        batch = next(self._it)
        self._pos.consumed += 1
        return batch

    def __len__(self) -> int:
        return len(self._it)

    def __getattr__(self, name: str) -> Any:  # the wrapped iterator's own attributes
        return getattr(self._it, name)


class _Resumable:
    """The methods of the tracked loader's class (see :func:`make_resumable`). Not a base class:
    ``__class__`` assignment needs the new class's first base to be the loader's own class."""

    _resilient_pos: _Position
    _resilient_base: type

    def __iter__(self) -> Iterator[Any]:
        pos = self._resilient_pos
        pending, pos.pending = pos.pending, None
        # a new pass: nothing to resume, or a position restored at its pass's end (every batch
        # yielded: the snapshot came between an epoch's last step and the next iter())
        if pending is None or pending["rng"] is None or _pass_over(self, pending):
            pos.iterators += 1
            pos.rng = _get_states(self)
            pos.consumed = 0
            return _Counting(self._resilient_base.__iter__(self), pos)  # type: ignore[attr-defined]
        restored = _get_states(self)
        _set_states(self, pending["rng"])
        try:  # the draws the original pass made, from the states it made them in
            it = self._resilient_base.__iter__(self)  # type: ignore[attr-defined]
            first = _draw_first_indices(it)
        finally:
            _set_states(self, restored)
        pos.rng, pos.consumed = pending["rng"], 0
        counting = _Counting(it, pos)
        skip = int(pending["consumed"])
        if first is not None:  # single process: advance the sampler, read nothing
            sampler_iter = itertools.chain(first, it._sampler_iter)
            for _ in range(skip):
                if next(sampler_iter, None) is None:
                    break
            it._sampler_iter = sampler_iter
            it._num_yielded += skip
            pos.consumed = skip
        else:  # worker processes: read the consumed batches again, so their RNGs advance alike
            for _ in range(skip):
                if next(counting, None) is None:
                    break
        return counting

    def state_dict(self) -> dict[str, Any]:
        pos = self._resilient_pos
        now = [g.get_state() for g in _generators(self)]  # (the global RNG: the runtime keeps it)
        return {"iterators": pos.iterators, "consumed": pos.consumed, "rng": pos.rng, "generators": now}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pos = self._resilient_pos
        gens = _generators(self)
        if len(gens) != len(state["generators"]):
            raise ValueError(
                f"the loader has {len(gens)} generator(s); the snapshot, {len(state['generators'])}"
            )
        for g, st in zip(gens, state["generators"], strict=True):
            g.set_state(st)
        pos.iterators = int(state["iterators"])
        pos.consumed = int(state["consumed"])
        pos.rng = None if state["rng"] is None else list(state["rng"])
        pos.pending = {"consumed": pos.consumed, "rng": pos.rng}


class _StatefulResumable:
    """The methods of a tracked ``StatefulDataLoader``'s class (torchdata; :func:`make_resumable`).

    Its own ``state_dict`` restores its position, but creating the iterator that resumes it
    draws the base and shared seeds again from the global RNG (or the loader's ``generator``),
    which the original pass drew from only at its start: every later random number of the run
    (dropout) would shift by those draws. Here an iterator that resumes a loaded state is made
    with those RNGs put back as they were; one that begins a pass draws as it always does. A
    state loaded at the very end of a pass (every batch yielded, the iterator not yet told so)
    is resumed as finished, so the next ``iter()`` begins the next pass the way the original
    run's did (a new iterator, or persistent workers reset) instead of an empty one. The batches
    yielded in the current pass are counted (and kept in the state, under ``_resilient``) for
    the step loop's epoch ends."""

    _resilient_pos: _Position
    _resilient_base: type
    next_iter_state: Any

    def _get_iterator(self) -> Any:
        base = self._resilient_base
        pos = self._resilient_pos
        if self.next_iter_state is None or pos.pending is None:  # a pass begins: the original's draws
            return base._get_iterator(self)  # type: ignore[attr-defined]
        gen = getattr(self, "generator", None)
        saved = torch.get_rng_state()
        try:
            it = base._get_iterator(self)  # type: ignore[attr-defined]
        finally:
            torch.set_rng_state(saved)
            # the loader's own generator as it was when the state was taken (its sampler's
            # restore winds it back to where the pass began, before that pass's seed draws)
            if isinstance(gen, torch.Generator) and pos.pending.get("generator") is not None:
                gen.set_state(pos.pending["generator"])
        if _pass_over(self, pos.pending):
            it._finished = True
        return it

    def __iter__(self) -> Iterator[Any]:
        pos = self._resilient_pos
        pending = pos.pending
        it = self._resilient_base.__iter__(self)  # type: ignore[attr-defined]
        pos.pending = None
        if pending is not None and not _pass_over(self, pending):
            pos.consumed = int(pending["consumed"])
        else:
            pos.iterators += 1
            pos.consumed = 0
            # worker processes: where this pass began, to replay it from (see load_state_dict)
            pos.start = copy.deepcopy(it.state_dict()) if _replays(it) else None
        return _Counting(it, pos)

    def state_dict(self) -> dict[str, Any]:
        pos = self._resilient_pos
        state = dict(self._resilient_base.state_dict(self))  # type: ignore[attr-defined]
        gen = getattr(self, "generator", None)
        state["_resilient"] = {
            "iterators": pos.iterators,
            "consumed": pos.consumed,
            "pass_start": pos.start,
            "generator": gen.get_state() if isinstance(gen, torch.Generator) else None,
        }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Worker processes' RNGs are no part of torchdata's state (a random augmentation in
        ``__getitem__`` would restart from the workers' seeds): a pass is resumed from the
        state it began in, its consumed batches read again by the workers, as torchdata itself
        replays the batches since its last snapshot (the main process's RNG is kept aside)."""
        state = dict(state)
        ours = state.pop("_resilient", None) or {}
        pos = self._resilient_pos
        pos.iterators = int(ours.get("iterators", 0))
        pos.consumed = int(ours.get("consumed", 0))
        start = ours.get("pass_start")
        pos.start = start
        pending: dict[str, Any] = {"consumed": pos.consumed, "generator": ours.get("generator")}
        if start is not None and pos.consumed > 0 and not _pass_over(self, pending):
            state = {**start, _STEPS_SINCE_SNAPSHOT: pos.consumed}
        self._resilient_base.load_state_dict(self, state)  # type: ignore[attr-defined]
        pos.pending = pending if state else None


# torchdata's multi-process iterator state: the batches read since its last snapshot (replayed)
_STEPS_SINCE_SNAPSHOT = "_steps_since_snapshot"


def _replays(it: Any) -> bool:
    """A worker-process iterator whose state replays the batches since a snapshot (torchdata's)."""
    if getattr(it, "_num_workers", 0) <= 0:
        return False
    try:
        return _STEPS_SINCE_SNAPSHOT in it.state_dict()
    except Exception:  # (another loader's iterator: its own state is used as it is)
        return False


def _pass_over(loader: Any, pending: dict[str, Any]) -> bool:
    """Whether a loaded position is at its pass's end (``finish_pass`` said so, or every batch
    of a loader with a length was yielded)."""
    if pending.get("new_pass", False):
        return True
    try:
        return int(pending["consumed"]) >= len(loader)
    except TypeError:  # (an iterable dataset without a length: its own state says)
        return False


def is_stateful_loader(loader: Any) -> bool:
    """torchdata's ``StatefulDataLoader`` (or one like it): it resumes through its own state."""
    return all(
        hasattr(loader, a) for a in ("next_iter_state", "_get_iterator", "state_dict", "load_state_dict")
    )


def batches_consumed(loader: Any) -> int | None:
    """How many batches the current pass of a tracked loader yielded, skipped ones of a restored
    pass included (None for anything else: a plain iterable counts what it yields itself)."""
    pos = getattr(loader, "_resilient_pos", None)
    return pos.consumed if pos is not None else None


def finish_pass(loader: Any) -> None:
    """A tracked loader restored after the last batch of a pass (``ctx.epochs`` knows): its next
    ``iter()`` begins a new pass, drawing from the restored RNG as the first run's did, instead of
    re-entering the finished one with nothing left to yield."""
    pos = getattr(loader, "_resilient_pos", None)
    if pos is None:
        return
    if is_stateful_loader(loader) and pos.pending is not None:
        pos.pending = {**pos.pending, "new_pass": True}  # (its own state would resume the old pass)
    else:
        pos.pending = None


def _draw_first_indices(it: Any) -> list[Any] | None:
    """Single-process iterator: its first batch of indices, drawn now (a ``RandomSampler``
    without a generator draws its seed at that point), to be put back in front. ``None`` for
    worker processes: theirs were drawn when the iterator was created."""
    if getattr(it, "_num_workers", 0) > 0 or not hasattr(it, "_sampler_iter"):
        return None
    if isinstance(getattr(it, "_dataset", None), IterableDataset):  # no sampler decides what comes next
        return None
    first = next(it._sampler_iter, None)
    return [] if first is None else [first]


def make_resumable(loader: DataLoader) -> DataLoader:
    """Give ``loader`` (in place) ``state_dict``/``load_state_dict`` and a resumable ``iter()``;
    a ``StatefulDataLoader``, an ``iter()`` that resumes its own state without a draw."""
    if hasattr(type(loader), "_resilient_base"):
        return loader
    cls = type(loader)
    sub = _classes.get(cls)
    if sub is None:
        if is_stateful_loader(loader):
            names: tuple[str, ...] = ("_get_iterator", "__iter__", "state_dict", "load_state_dict")
            methods = {k: _StatefulResumable.__dict__[k] for k in names}
        else:
            methods = {k: _Resumable.__dict__[k] for k in ("__iter__", "state_dict", "load_state_dict")}
        sub = type(
            f"Resumable{cls.__name__}",
            (cls,),
            {**methods, "_resilient_base": cls, "__module__": cls.__module__},
        )
        _classes[cls] = sub
    object.__setattr__(loader, "_resilient_pos", _Position())
    loader.__class__ = sub
    return loader
